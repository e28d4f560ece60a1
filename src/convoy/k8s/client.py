"""The one place Convoy talks to a Kubernetes API server.

``Api`` is the protocol the control logic (``convoy.k8s.control``) needs: create, get,
list, patch, delete, watch and pod logs on a handful of resource types, with objects as plain
dicts. ``KubeApi`` implements it with the official ``kubernetes`` client (``CustomObjectsApi``
for the custom resources, the core and batch APIs for ConfigMaps, Jobs and Pods) and turns
every ``ApiException`` into a one-line ``K8sError`` that says what to do: a missing CRD names
the operator to install, a 403 names the verb and resource to grant, a 409 says delete or
rename. Tests drive the control logic with a fake ``Api`` and this class against a real
kube-apiserver.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from convoy.k8s import K8sError, require


@dataclass(frozen=True)
class Resource:
    """One API resource type: ``group/version``, its plural and kind."""

    group: str
    version: str
    plural: str
    kind: str
    install_hint: str = ""
    """What to install when the API server does not know this type."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``rayjobs.ray.io``, as RBAC rules and ``kubectl auth can-i`` spell it."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


KUBERAY_HINT = (
    "the KubeRay operator is not installed (its CRDs are missing); install KubeRay v1.7: "
    "helm repo add kuberay https://ray-project.github.io/kuberay-helm/ && "
    "helm install kuberay-operator kuberay/kuberay-operator --version 1.7.0"
)
KUBEFLOW_HINT = (
    "the Kubeflow training operator is not installed (no PyTorchJob CRD); install v1.9: "
    "kubectl apply --server-side -k "
    '"github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.4"'
)
RAYJOB = Resource("ray.io", "v1", "rayjobs", "RayJob", KUBERAY_HINT)
RAYCLUSTER = Resource("ray.io", "v1", "rayclusters", "RayCluster", KUBERAY_HINT)
PYTORCHJOB = Resource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", KUBEFLOW_HINT)
CONFIGMAP = Resource("", "v1", "configmaps", "ConfigMap")
JOB = Resource("batch", "v1", "jobs", "Job")
POD = Resource("", "v1", "pods", "Pod")
BY_KIND = {r.kind: r for r in (RAYJOB, RAYCLUSTER, PYTORCHJOB, CONFIGMAP, JOB, POD)}
WORKLOADS = (RAYJOB, RAYCLUSTER, PYTORCHJOB)


class Api(Protocol):
    """What ``convoy.k8s.control`` needs from an API server."""

    def create(
        self, resource: Resource, namespace: str, body: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]: ...

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]: ...

    def list(
        self, resource: Resource, namespace: str, label_selector: str = ""
    ) -> list[dict[str, Any]]: ...

    def patch(
        self, resource: Resource, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]: ...

    def delete(self, resource: Resource, namespace: str, name: str) -> None: ...

    def watch(
        self, resource: Resource, namespace: str, name: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Events (``ADDED``/``MODIFIED``/``DELETED``, or ``ERROR`` when the version expired)
        of one object after ``resource_version``, until the server ends the stream."""
        ...

    def pod_logs(self, namespace: str, pod: str, tail_lines: int | None = None) -> str: ...


class NotFound(K8sError):
    """The object (not its type) does not exist."""


class AlreadyExists(K8sError):
    """An object of that name exists (409)."""


class MissingKind(K8sError):
    """The API server does not serve this resource type: its CRD (operator) is missing."""


class KubeApi:
    """``Api`` over the official client. Build it with ``KubeApi.connect()``."""

    def __init__(self, api_client: Any) -> None:
        k8s = require("kubernetes")
        self.api_client = api_client
        self.custom = k8s.client.CustomObjectsApi(api_client)
        self.core = k8s.client.CoreV1Api(api_client)
        self.batch = k8s.client.BatchV1Api(api_client)
        self.server = api_client.configuration.host

    @classmethod
    def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeApi:
        """From a kubeconfig (``--kubeconfig``, ``KUBECONFIG`` or ``~/.kube/config``), or the
        pod's service account when run inside a cluster with no kubeconfig."""
        k8s = require("kubernetes")
        yaml = require("yaml")
        configuration = k8s.client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        source = (
            "--kubeconfig" if kubeconfig else "KUBECONFIG" if "KUBECONFIG" in os.environ else ""
        )
        named = f"{source}={path}" if source else path
        try:
            # KUBECONFIG read now: the client reads it once, when it is imported.
            k8s.config.load_kube_config(
                config_file=kubeconfig or os.environ.get("KUBECONFIG") or None,
                context=context,
                client_configuration=configuration,
            )
        except yaml.YAMLError as exc:
            raise K8sError(f"kubeconfig {named}: not valid YAML ({_one_line(exc)})") from None
        except (k8s.config.ConfigException, FileNotFoundError) as exc:
            reason = _one_line(exc).rstrip(".")
            if isinstance(exc, FileNotFoundError) or "No configuration found" in reason:
                reason = f"no file at {named}" if source else reason
            if kubeconfig or context:
                raise K8sError(f"kubeconfig {named}: {reason}") from None
            try:
                k8s.config.load_incluster_config(client_configuration=configuration)
            except k8s.config.ConfigException:
                raise K8sError(
                    f"no Kubernetes cluster configured ({reason}); set KUBECONFIG or pass "
                    "--kubeconfig (or run inside a pod with a service account)"
                ) from None
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            # A kubeconfig that parses but is malformed (a list where a map belongs, ...).
            raise K8sError(f"kubeconfig {named}: malformed ({_one_line(exc)})") from None
        if not configuration.verify_ssl:
            # The kubeconfig asks for insecure-skip-tls-verify: the user knows; one warning
            # per request would bury the output.
            urllib3 = require("urllib3")
            warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
        return cls(k8s.client.ApiClient(configuration))

    # -- calls ------------------------------------------------------------------------------

    def create(
        self, resource: Resource, namespace: str, body: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]:
        extra = {"dry_run": "All"} if dry_run else {}
        name = body.get("metadata", {}).get("name", "")
        with self._errors("create", resource, namespace, name):
            if resource in WORKLOADS:
                return dict(
                    self.custom.create_namespaced_custom_object(
                        resource.group, resource.version, namespace, resource.plural, body, **extra
                    )
                )
            method = getattr(self._typed(resource), f"create_namespaced_{_snake(resource)}")
            return _json(method(namespace, body, _preload_content=False, **extra))

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        with self._errors("get", resource, namespace, name):
            if resource in WORKLOADS:
                return dict(
                    self.custom.get_namespaced_custom_object(
                        resource.group, resource.version, namespace, resource.plural, name
                    )
                )
            method = getattr(self._typed(resource), f"read_namespaced_{_snake(resource)}")
            return _json(method(name, namespace, _preload_content=False))

    def list(
        self, resource: Resource, namespace: str, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        with self._errors("list", resource, namespace, ""):
            if resource in WORKLOADS:
                found = self.custom.list_namespaced_custom_object(
                    resource.group,
                    resource.version,
                    namespace,
                    resource.plural,
                    label_selector=label_selector,
                )
            else:
                method = getattr(self._typed(resource), f"list_namespaced_{_snake(resource)}")
                found = _json(
                    method(namespace, label_selector=label_selector, _preload_content=False)
                )
        return list(found.get("items", []))

    def patch(
        self, resource: Resource, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """A merge patch (JSON merge for custom resources, strategic for the others)."""
        with self._errors("patch", resource, namespace, name):
            if resource in WORKLOADS:
                return dict(
                    self.custom.patch_namespaced_custom_object(
                        resource.group, resource.version, namespace, resource.plural, name, body
                    )
                )
            method = getattr(self._typed(resource), f"patch_namespaced_{_snake(resource)}")
            return _json(method(name, namespace, body, _preload_content=False))

    def delete(self, resource: Resource, namespace: str, name: str) -> None:
        # Background propagation: the API server's garbage collector removes what the object
        # owns (a RayJob's RayCluster, submitter Job and recipe ConfigMap) after it.
        with self._errors("delete", resource, namespace, name):
            if resource in WORKLOADS:
                self.custom.delete_namespaced_custom_object(
                    resource.group,
                    resource.version,
                    namespace,
                    resource.plural,
                    name,
                    propagation_policy="Background",
                )
                return
            method = getattr(self._typed(resource), f"delete_namespaced_{_snake(resource)}")
            method(name, namespace, propagation_policy="Background", _preload_content=False)

    def watch(
        self, resource: Resource, namespace: str, name: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        k8s = require("kubernetes")
        stream = k8s.watch.Watch().stream(
            self.custom.list_namespaced_custom_object,
            resource.group,
            resource.version,
            namespace,
            resource.plural,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
            timeout_seconds=timeout_s,
        )
        try:
            with self._errors("watch", resource, namespace, name):
                for event in stream:
                    yield str(event["type"]), dict(event["object"])
        except K8sError as exc:
            if "410" not in str(exc) and "Expired" not in str(exc):
                raise
            yield "ERROR", {}  # the version expired: the caller reads the object again

    def pod_logs(self, namespace: str, pod: str, tail_lines: int | None = None) -> str:
        with self._errors("get", Resource("", "v1", "pods/log", "Pod"), namespace, pod):
            extra = {"tail_lines": tail_lines} if tail_lines else {}
            response = self.core.read_namespaced_pod_log(
                pod, namespace, _preload_content=False, **extra
            )
            return str(response.data.decode(errors="replace"))

    # -- helpers ----------------------------------------------------------------------------

    def _typed(self, resource: Resource) -> Any:
        return self.batch if resource.group == "batch" else self.core

    def _errors(self, verb: str, resource: Resource, namespace: str, name: str) -> Any:
        return _Translate(self, verb, resource, namespace, name)


def _snake(resource: Resource) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", resource.kind).lower()


def _json(response: Any) -> dict[str, Any]:
    return dict(json.loads(response.data))


class _Translate:
    """Context manager: ``ApiException`` and connection errors -> ``K8sError``."""

    def __init__(self, api: KubeApi, verb: str, resource: Resource, namespace: str, name: str):
        self.api, self.verb, self.resource = api, verb, resource
        self.namespace, self.name = namespace, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, K8sError):
            return
        k8s = require("kubernetes")
        urllib3 = require("urllib3")
        if isinstance(exc, k8s.client.ApiException):
            raise explain(exc.status, exc.body, self.verb, self.resource, self.namespace, self.name)
        if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
            raise K8sError(
                f"cannot reach the Kubernetes API server at {self.api.server}: "
                f"{type(exc).__name__}; check the kubeconfig's server and your network"
            ) from None


def explain(
    status: int | None, body: Any, verb: str, resource: Resource, namespace: str, name: str
) -> K8sError:
    """One line for an API error: what happened and what to do about it."""
    try:
        answer = json.loads(body) if body else {}
    except (TypeError, ValueError):
        answer = {}
    message = str(answer.get("message", "") or body or "")
    details = answer.get("details") or {}
    what = f"{resource.kind} {namespace}/{name}" if name else f"{resource.kind}s in {namespace}"
    if status == 404:
        if details.get("kind") == "namespaces":
            return K8sError(
                f"namespace {namespace!r} does not exist; create it (kubectl create namespace "
                f"{namespace}) or set k8s.namespace / -n"
            )
        if details.get("name") and verb != "create":
            return NotFound(f"{what} not found")
        if resource.install_hint:
            return MissingKind(
                f"the API server does not know {resource.kind} ({resource.qualified}/"
                f"{resource.version}): {resource.install_hint}"
            )
        return NotFound(f"{what} not found")
    if status == 403:
        user = re.search(r'User "([^"]*)"', message)
        who = f"user {user.group(1)!r}" if user else "this user"
        group = resource.group or '""'
        return K8sError(
            f"forbidden (403): {who} may not {verb} {resource.qualified} in namespace "
            f"{namespace!r}; ask for an RBAC Role granting verbs [{verb}] on resources "
            f"[{resource.plural}] in apiGroups [{group}] (check: kubectl auth can-i {verb} "
            f"{resource.qualified} -n {namespace})"
        )
    if status == 409:
        return AlreadyExists(
            f"{what} already exists (409); delete it (convoy k8s delete {name} -n {namespace}) "
            "or rename the run (-o k8s.name=NEW or -o run.name=NEW)"
        )
    if status == 422:
        causes = [
            f"{c.get('field', '?')}: {c.get('message', '')}" for c in details.get("causes", [])
        ]
        return K8sError(f"the API server refused {what} (422): " + ("; ".join(causes) or message))
    if status == 401:
        return K8sError(
            "not authenticated (401): the kubeconfig's credentials were refused; refresh them"
        )
    if status == 400 and "pods/log" in resource.plural:
        return K8sError(f"no logs from pod {namespace}/{name} yet: {message}")
    return K8sError(f"{verb} {what}: {status} {message}".rstrip())


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
