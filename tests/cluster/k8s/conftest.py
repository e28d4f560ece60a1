"""A real kube-apiserver + etcd on loopback for the ``convoy k8s`` tests (k8s-envtest).

``envtest`` (module-scoped) builds the server once per machine (``build_apiserver.sh``
beside this file returns at once when it is built), starts one server for the module that
uses it with the KubeRay v1.7.0 CRDs created from the copies Convoy ships (their CEL rules
stripped: a 1.20 server rejects the field), and stops it by its pid files after that module.
Where it cannot (no build tools, no network to the Debian archive, no envtest scripts) every
test here skips with the reason.

There is no kubelet, scheduler or controller: nothing runs a pod and no operator moves a
status. ``Operator.set_status`` plays KubeRay's part by patching the status subresource.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ENVTEST_SCRIPTS = Path(
    os.environ.get("CONVOY_ENVTEST_SCRIPTS", REPO.parent / "shared" / "k8s-envtest")
)
# Convoy's own build of what those scripts start (the Makefile's ENVTEST_BUILD: it says why).
BUILD = Path(__file__).with_name("build_apiserver.sh")
CRDS = REPO / "src" / "convoy" / "k8s" / "crds"
BUILD_TIMEOUT_S = 1200


@dataclass
class Envtest:
    kubeconfig: str
    api: Any
    """``convoy.k8s.client.KubeApi`` as the admin user."""

    def set_status(self, kind: str, name: str, status: dict[str, Any], namespace: str = "default"):
        """What the operator would do: patch ``status`` (a merge patch of the subresource)."""
        from convoy.k8s.client import BY_KIND

        resource = BY_KIND[kind]
        return self.api.custom.patch_namespaced_custom_object_status(
            resource.group,
            resource.version,
            namespace,
            resource.plural,
            name,
            {"status": status},
        )


BUILD_LOCK = "/tmp/convoy-envtest-build.lock"  # the Makefile's ENVTEST_LOCK


def _skip(reason: str) -> None:
    print(f"\nk8s-envtest: skipping: {reason}", file=sys.stderr)
    pytest.skip(reason)


def _build() -> None:
    if not (ENVTEST_SCRIPTS / "start.sh").exists():
        _skip(f"no k8s-envtest scripts at {ENVTEST_SCRIPTS} (set CONVOY_ENVTEST_SCRIPTS)")
    try:
        # `make test` may have started the build in the background: wait on its lock.
        lock = ["flock", BUILD_LOCK] if shutil.which("flock") else []
        done = subprocess.run(
            [*lock, "bash", str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        _skip(f"{BUILD.name} did not finish in {BUILD_TIMEOUT_S} s")
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        _skip(f"{BUILD.name} failed (exit {done.returncode}): {tail}")


def _create_crds(api: Any) -> None:
    import kubernetes

    stripped = subprocess.run(
        [
            sys.executable,
            str(ENVTEST_SCRIPTS / "strip-cel.py"),
            *sorted(map(str, CRDS.glob("*.yaml"))),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    extensions = kubernetes.client.ApiextensionsV1Api(api.api_client)
    names = []
    for crd in yaml.load_all(stripped, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        # create, not a client-side apply: that would store the whole CRD in an annotation,
        # over the 256 KiB limit for KubeRay's.
        extensions.create_custom_resource_definition(crd)
        names.append(crd["metadata"]["name"])
    deadline = time.monotonic() + 30
    while names and time.monotonic() < deadline:
        crd = extensions.read_custom_resource_definition(names[0])
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            names.pop(0)
        else:
            time.sleep(0.2)
    # Pods need their service account to exist (no controller makes "default" here).
    core = kubernetes.client.CoreV1Api(api.api_client)
    core.create_namespaced_service_account("default", {"metadata": {"name": "default"}})


# Module scope: the server and etcd use ~3 CPU-s a minute idle (measured), and only
# test_k8s_apiserver.py needs them; kept for the session, they idled through the rest of the
# cluster tier (~20 minutes).
@pytest.fixture(scope="module")
def envtest() -> Iterator[Envtest]:
    pytest.importorskip("kubernetes", reason="the k8s extra is not installed")
    pytest.importorskip("celpy", reason="the k8s extra is not installed")
    if shutil.which("openssl") is None or shutil.which("curl") is None:
        _skip("k8s-envtest's start.sh needs openssl and curl")
    _build()
    run_dir = tempfile.mkdtemp(prefix="convoy-envtest-")
    started = subprocess.run(
        ["bash", str(ENVTEST_SCRIPTS / "start.sh"), run_dir], capture_output=True, text=True
    )
    try:
        if started.returncode != 0:
            _skip(f"k8s-envtest start.sh failed: {started.stderr.strip()[-300:]}")
        from convoy.k8s.client import KubeApi

        # The envtest kubeconfig skips TLS verification (a throwaway self-signed server).
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
        kubeconfig = started.stdout.strip().splitlines()[-1]
        api = KubeApi.connect(kubeconfig)
        _create_crds(api)
        yield Envtest(kubeconfig, api)
    finally:
        subprocess.run(["bash", str(ENVTEST_SCRIPTS / "stop.sh"), run_dir], capture_output=True)


@pytest.fixture(autouse=True)
def _quiet_tls_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
        yield
