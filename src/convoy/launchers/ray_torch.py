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

from ray.train.torch import TorchConfig, TorchTrainer
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


class ConvoyTorchTrainer(TorchTrainer):
    """Ray Train's ``TorchTrainer``, without the helpers that only serve a dashboard where Ray
    has none (a private local Ray, a cluster started without one).

    - The placement-group cleaner is a detached actor that asks the dashboard's state API
      every second whether the run's controller is alive, to free the workers' placement
      group if the controller dies while Ray keeps running. Without a state API each question
      waits out its 10 s timeout, and the controller waits 12 s for the cleaner to stop at the
      end of every run. A private Ray is stopped with its run, which frees everything.
    - Ray Train's own metrics (controller and worker callbacks) feed the dashboard's Grafana
      panels; they are kept when the run exports Prometheus metrics (``monitor.prometheus``).
    """

    def __init__(self, *args: Any, prometheus: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prometheus = prometheus

    def _create_default_callbacks(self) -> list[Any]:
        from ray.train.v2._internal.callbacks.metrics import (
            ControllerMetricsCallback,
            WorkerMetricsCallback,
        )
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback,
        )

        from convoy.launchers.ray_local import state_api_running

        # mypy sees Train V1's TorchTrainer; Ray 2.60 exports V2's, which has this method.
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        if state_api_running():
            return callbacks
        dropped: tuple[type, ...] = (PlacementGroupCleanerCallback,)
        if not self._prometheus:
            dropped += (ControllerMetricsCallback, WorkerMetricsCallback)
        return [c for c in callbacks if not isinstance(c, dropped)]
