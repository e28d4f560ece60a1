"""What runs in Ray Train's controller for a Convoy run, importing neither torch nor Convoy's engine.

Ray Train's controller is an actor (a process of its own) that unpickles the run's backend
configuration, scaling policy and callbacks, importing the modules that define them. Ray's
``TorchConfig`` lives in a module that imports torch at its top (1.0-1.2 CPU-s a launch, the
controller's largest import after Ray Train's own); so the backend here calls Ray's torch
functions by name on the workers, which import torch anyway, and the controller never does.
``tests/unit/test_launcher_helpers.py`` checks that importing this module loads no torch.

The process group's backend also puts each worker's gloo / NCCL socket on its node's
interface: every worker looks up the interface that holds its Ray node IP and exports
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (unless the user set them) before
``init_process_group``. Without this, gloo advertises the address the host name resolves to,
which is loopback on many machines, and a run whose workers span nodes fails with ``Gloo
connectFullMesh failed``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
    ResourceRequestPriority,
)
from ray.exceptions import GetTimeoutError
from ray.train._internal.autoscaling_coordinator_client import build_train_resource_request
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.execution.scaling_policy import (
    AUTOSCALING_REQUESTS_EXPIRE_TIME_S,
    FixedScalingPolicy,
)
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    TrainAutoscalingCoordinatorClient,
)
from ray.train.v2._internal.util import TrainingFramework

from convoy.network import socket_interface_env

logger = logging.getLogger(__name__)

# How long a worker group trains before the helpers that serve long runs start: Ray Train's
# preemption watcher and the autoscaling coordinator's request. Each is a Python process
# (about 1 CPU-s to start) that Ray Train starts as training begins, where it slowed a 2-core
# machine's first steps (warm first step 1.61x -> 1.48x torchrun's without the watcher).
# A preemption in the first seconds loses only those seconds, and the workers' placement
# group is already the autoscaler's demand.
LONG_RUN_HELPERS_AFTER_S = 10.0


# The functions below run on the workers (``worker_group.execute``): the controller only
# names them, and each imports Ray's torch helpers where torch is imported anyway.


def use_node_interface() -> dict[str, str]:
    """On a worker: export the socket interface variables for this Ray node's IP."""
    import ray.util

    chosen = socket_interface_env(ray.util.get_node_ip_address())
    os.environ.update(chosen)
    return chosen


def set_distributed_env(address: str, port: int) -> None:
    """On a worker: ``MASTER_ADDR`` / ``MASTER_PORT`` and torchrun's rank variables, as Ray's
    torch backend sets them before ``init_process_group``."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)
    _set_torch_distributed_env_vars()


def init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    """On a worker: join the process group (Ray's torch backend's own set-up)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(backend, world_rank, world_size, "env://", timeout_s)


def shut_down_process_group(destroy_process_group: bool) -> None:
    """On a worker: leave the process group and free cached GPU memory."""
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


class _DeviceContext:
    """Ray's ``TorchConfigContextManager`` (the worker's default CUDA device), entered on the
    worker around the train function; imported there."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        self._inner.__enter__()

    def __exit__(self, *exc: object) -> bool:
        return bool(self._inner.__exit__(*exc))


class ProcessGroupBackend(Backend):
    """Ray's torch backend (``_TorchBackend``) for gloo and NCCL with the ``env://`` init, each
    worker's socket on its node's interface, run from the controller without torch."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(use_node_interface)
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(set_distributed_env, address=address, port=port)
        size = len(worker_group)
        joined = [
            worker_group.execute_single_async(
                rank,
                init_process_group,
                backend=backend_config.backend,
                world_rank=rank,
                world_size=size,
                timeout_s=backend_config.timeout_s,
            )
            for rank in range(size)
        ]
        ray.get(joined)

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        left = worker_group.execute_async(
            shut_down_process_group, destroy_process_group=len(worker_group) > 1
        )
        timeout_s = ray_constants.env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(left, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("Torch process group shutdown timed out after %s seconds", timeout_s)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """The process group's backend (``gloo`` or ``nccl``) and collective timeout: what Ray's
    ``TorchConfig`` holds, read by ``TorchTrainer`` the same way."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> type:
        return _DeviceContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class DeferredPreemptionCallback(PreemptionCallback):
    """Ray Train's preemption watcher, started once the worker group has trained
    ``LONG_RUN_HELPERS_AFTER_S`` rather than as it starts. A drain notice that came before
    is still seen: the watcher's first poll reads the node's drain state from the GCS."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting: tuple[Any, float] | None = None

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._stop_watcher()
        self._waiting = (worker_group, time.monotonic())

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        if self._waiting is None:
            return
        worker_group, started = self._waiting
        if time.monotonic() - started >= LONG_RUN_HELPERS_AFTER_S:
            self._waiting = None
            super().after_worker_group_start(worker_group)

    def before_worker_group_shutdown(self, worker_group: Any) -> None:
        self._waiting = None
        super().before_worker_group_shutdown(worker_group)

    def after_worker_group_abort(self, worker_group_context: Any) -> None:
        self._waiting = None
        super().after_worker_group_abort(worker_group_context)


class NoAutoscalerScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy without resource requests, for a private Ray: one fixed
    node with no autoscaler to read them, where Ray Train would start a coordinator actor
    (a process) only to pass them on."""

    def after_controller_start(self, train_run_context: Any) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass


class _RequestWithoutWaiting(TrainAutoscalingCoordinatorClient):
    def send_resource_request(self, scaling_config: Any, num_workers: int) -> None:
        resources, label_selectors = build_train_resource_request(scaling_config, num_workers)
        # Ray's ActorProxy stub types the method as a plain callable.
        self._autoscaling_coordinator.request_resources.remote(  # type: ignore[attr-defined]
            requester_id=self._requester_id,
            resources=resources,
            label_selectors=label_selectors,
            expire_after_s=AUTOSCALING_REQUESTS_EXPIRE_TIME_S,
            priority=ResourceRequestPriority.HIGH,
        )
        self._latest_autoscaling_request_time = time.monotonic()


class UnblockedRequestsScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy whose resource requests to the cluster's autoscaler do
    not hold up the start. Ray Train creates the coordinator actor (detached, one per
    cluster) as its controller starts and waits up to 5 s for each request's reply: on a fresh
    ``ray start`` head its process starts beside the workers' (Ray starts as many at once as
    the node has CPUs) and held their start by 1.3-1.9 s here. The workers' placement group is
    a demand the autoscaler sees either way; the request only adds Ray Data's coordination
    (keep these resources for training), which needs no reply and starts once the workers
    have trained ``LONG_RUN_HELPERS_AFTER_S``."""

    def after_controller_start(self, train_run_context: Any) -> None:
        self._requester_id = f"train-{train_run_context.run_id}"

    def _maybe_send_resource_request(self) -> None:
        if self._coordinator_client is not None:
            super()._maybe_send_resource_request()

    def make_decision_for_running_worker_group(
        self, worker_group_state: Any, worker_group_status: Any
    ) -> Any:
        if (
            self._coordinator_client is None
            and worker_group_state is not None
            and time.monotonic() - worker_group_state.start_time < LONG_RUN_HELPERS_AFTER_S
        ):
            return super().make_decision_for_running_worker_group(
                worker_group_state, worker_group_status
            )
        if self._coordinator_client is None:
            assert self._requester_id is not None
            self._coordinator_client = _RequestWithoutWaiting(self._requester_id)
            self._send_resource_request()
        return super().make_decision_for_running_worker_group(
            worker_group_state, worker_group_status
        )
