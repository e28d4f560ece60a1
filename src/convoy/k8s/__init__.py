"""``convoy k8s``: run a recipe on Kubernetes through KubeRay (or Kubeflow's PyTorchJob).

- ``render``: the job as plain manifests (a ``RayJob`` by default, a long-lived ``RayCluster``,
  or a ``PyTorchJob``), with the resolved recipe shipped in a ConfigMap or inline, so the pods
  run ``convoy train`` on exactly what ran on the laptop.
- ``validate``: everything checked before a byte is sent: the job against what pods can hold,
  the manifest against the KubeRay v1.7.0 CRD schemas shipped in ``crds/``, their CEL rules,
  and the checks the operator would otherwise only make after creation (``ValidationFailed``).
- ``client``: a thin adapter over the official ``kubernetes`` client that turns API errors
  into one-line ``K8sError`` messages; ``control`` (submit, status, watch, logs, delete, gc)
  talks only to that adapter, so it runs against a fake or a real API server alike.

The Kubernetes libraries are an extra (``pip install 'convoy[k8s]'``) imported lazily:
``import convoy`` and ``convoy.k8s.render`` work without them.
"""

from __future__ import annotations

import importlib
from typing import Any

from convoy.errors import ConvoyError
from convoy.imports import missing_extra


class K8sError(ConvoyError):
    """A Kubernetes request failed, or a manifest would be refused; one line per problem."""


def require(module: str) -> Any:
    """Import one of the ``k8s`` extra's modules, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        package = PACKAGES.get(package, package)
        raise K8sError(missing_extra("convoy k8s", package, "k8s")) from None


PACKAGES = {"celpy": "cel-python"}
"""The pip name of a module of the ``k8s`` extra, where it differs."""
