"""Names and labels of the objects Convoy puts on a cluster.

One name per run: the ``RayJob`` / ``RayCluster`` / ``PyTorchJob`` is called by the run id,
its ConfigMap ``<run id>-recipe``, and every object carries the labels below, which is how
``convoy k8s gc`` finds what Convoy left behind (and nothing else).
"""

from __future__ import annotations

import hashlib
import re

from convoy.config import Job

MANAGED_BY = "app.kubernetes.io/managed-by"
RUN_ID = "convoy.io/run-id"
KIND = "convoy.io/kind"
"""What Convoy rendered: rayjob, raycluster or pytorchjob (a RayJob's own RayCluster keeps
the rayjob value, as KubeRay copies the RayJob's labels onto it)."""
RUN_NAME = "convoy.io/run-name"
"""Annotation: the full ``run.name`` (a label value cannot hold every run name)."""
CONVOY = "convoy"

MAX_NAME = {"rayjob": 47, "raycluster": 53, "pytorchjob": 63}
"""KubeRay: a RayJob name leaves 6 characters for its RayCluster's suffix (53 - 6); a
RayCluster name leaves room for its longest Service suffix (63 - len("-serve-svc")).
PyTorchJob: a DNS-1035 label (the operator names Services after it)."""

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


QUALIFIED_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def is_qualified_name(key: str) -> bool:
    """A label / node-selector key: ``[prefix/]name``, the prefix a DNS-1123 subdomain, the
    name at most 63 letters, digits, '-', '_' and '.' starting and ending alphanumeric."""
    prefix, slash, name = key.rpartition("/")
    if slash and not is_dns1123_subdomain(prefix):
        return False
    return len(name) <= 63 and bool(QUALIFIED_NAME_PART.match(name))


STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def is_extended_resource(name: str) -> bool:
    """A resource a device plugin advertises: ``domain/name`` (``nvidia.com/gpu``,
    ``vpc.amazonaws.com/efa``), outside ``kubernetes.io`` and not ``requests.*``."""
    prefix, slash, _ = name.partition("/")
    return (
        bool(slash)
        and is_qualified_name(name)
        and "." in prefix
        and not prefix.endswith("kubernetes.io")
        and not name.startswith("requests.")
    )


def is_resource_name(name: str) -> bool:
    """A container resource name: a standard one, ``hugepages-<size>``, or extended."""
    return (
        name in STANDARD_RESOURCES
        or (name.startswith("hugepages-") and is_qualified_name(name))
        or is_extended_resource(name)
    )


# docker/distribution's reference grammar (reference/regexp.go), anchored.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(
    rf"^(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?$"
)
SHA256_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_dns1035(name: str, limit: int = 63) -> bool:
    return len(name) <= limit and bool(DNS_1035.match(name))


def is_dns1123_label(name: str) -> bool:
    return len(name) <= 63 and bool(DNS_1123_LABEL.match(name))


def is_dns1123_subdomain(name: str) -> bool:
    return len(name) <= 253 and bool(DNS_1123_SUBDOMAIN.match(name))


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(LABEL_VALUE.match(value))


def resource_name(job: Job, kind: str, generated: bool = False) -> str:
    """The objects' name and run id: ``k8s.name`` as given (validation refuses a bad one), or
    ``run.name`` made DNS-1035 (``vit_tiny-digits`` -> ``vit-tiny-digits``). A generated
    run name that is too long is cut, with a short hash of the whole so two cut names differ;
    a run named by hand is never cut (validation says it is too long instead)."""
    if job.k8s.name:
        return job.k8s.name
    name = dns1035(job.run.name or "convoy")
    return shorten(name, MAX_NAME[kind]) if generated else name


def dns1035(text: str) -> str:
    """Lowercase, runs of other characters as one '-', starting with a letter."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return name if name[:1].isalpha() else f"run-{name}".rstrip("-")


def shorten(name: str, limit: int) -> str:
    """``name`` cut to ``limit`` characters, ending in a 6-character hash of the whole."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: limit - 7].rstrip('-')}-{digest}"


def recipe_configmap_name(name: str) -> str:
    return f"{name}-recipe"


def labels(job: Job, name: str, kind: str) -> dict[str, str]:
    """Labels on every object of one run (the user's ``k8s.labels`` first, ours win)."""
    return {**job.k8s.labels, MANAGED_BY: CONVOY, RUN_ID: name, KIND: kind}


def selector(**extra: str) -> str:
    """A label selector for Convoy's objects, e.g. ``selector(**{RUN_ID: name})``."""
    pairs = {MANAGED_BY: CONVOY, **extra}
    return ",".join(f"{k}={v}" for k, v in pairs.items())
