"""Ray Train's torch backend, with each worker's gloo / NCCL socket on its node's interface.

Ray Train creates the process group (``TorchConfig``) before the train function runs, so the
interface must be chosen in the backend's ``on_start``: every worker looks up the interface
that holds its Ray node IP and exports ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (unless
the user set them) before ``init_process_group``. Without this, gloo advertises the address
the host name resolves to, which is loopback on many machines, and a run whose workers span
nodes fails with ``Gloo connectFullMesh failed``. Imported only by the ``ray`` launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from convoy.network import socket_interface_env


def use_node_interface() -> dict[str, str]:
    """On a worker: export the socket interface variables for this Ray node's IP."""
    import ray.util

    chosen = socket_interface_env(ray.util.get_node_ip_address())
    os.environ.update(chosen)
    return chosen


class _NodeInterfaceBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(use_node_interface)
        super().on_start(worker_group, backend_config)


@dataclass
class NodeInterfaceTorchConfig(TorchConfig):
    """``TorchConfig`` whose process group uses each node's own interface."""

    @property
    def backend_cls(self) -> type:
        return _NodeInterfaceBackend
