"""Ray Train's torch backend, with each worker's gloo / NCCL socket on its node's interface.

Ray Train creates the process group (``TorchConfig``) before the train function runs, so the
interface must be chosen in the backend's ``on_start``: every worker looks up the interface
that holds its Ray node IP and exports ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (unless
the user set them) before ``init_process_group``. Without this, gloo advertises the address
the host name resolves to, which is loopback on many machines, and a run whose workers span
nodes fails with ``Gloo connectFullMesh failed``. Imported only by the ``ray`` launcher.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray._private.ray_constants as ray_constants
from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
    ResourceRequestPriority,
)
from ray.train._internal.autoscaling_coordinator_client import build_train_resource_request
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _TorchBackend
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.constants import (
    DEFAULT_ENABLE_PREEMPTION_WATCHER,
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
)
from ray.train.v2._internal.execution.scaling_policy import (
    AUTOSCALING_REQUESTS_EXPIRE_TIME_S,
    FixedScalingPolicy,
)
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    TrainAutoscalingCoordinatorClient,
)

from convoy.launchers import ray_local
from convoy.network import socket_interface_env

# How long a worker group trains before the helpers that serve long runs start: Ray Train's
# preemption watcher and the autoscaling coordinator's request. Each is a Python process
# (about 1 CPU-s to start) that Ray Train starts as training begins, where it slowed a 2-core
# machine's first steps (warm first step 1.61x -> 1.48x torchrun's without the watcher).
# A preemption in the first seconds loses only those seconds, and the workers' placement
# group is already the autoscaler's demand.
LONG_RUN_HELPERS_AFTER_S = 10.0


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
    """Ray Train's ``TorchTrainer``, without the helpers that serve nothing in a given run.

    Each helper Ray Train starts is an actor: a Python process that imports Ray (about 1.5 s
    of CPU each here), competing with the workers' start on a small machine.

    - The placement-group cleaner is a detached actor that asks the dashboard's state API
      every second whether the run's controller is alive, to free the workers' placement
      group if the controller dies while the job's driver lives on (Ray frees a job's groups
      when its driver exits). ``sole_run`` says the driver is ``convoy train``'s, which exits
      when its controller dies: the cleaner has nothing to do there, and its start (a process
      while the workers start) is left out. Without a state API each of its questions waits
      out a 10 s timeout and the controller waits 12 s for it to stop at the end of every run,
      so it is left out then too. Tune's trials (one driver, many runs) keep it elsewhere.
    - Ray Train's own metrics (controller and worker callbacks) feed the dashboard's Grafana
      panels; they are kept when the run exports Prometheus metrics (``monitor.prometheus``).
    - The dataset manager serves Ray Data shards; a run without Ray Data datasets has none.
    - The autoscaling coordinator passes the workers' resource request to the cluster's
      autoscaler: a private Ray (``private_ray``) is one fixed node with none, and elsewhere
      the request is sent once the workers have trained ``LONG_RUN_HELPERS_AFTER_S``, without
      waiting for a reply.
    - The preemption watcher polls the GCS for drained nodes. A private Ray's one node is
      this machine, which no drain notice reaches, so it has none (unless
      ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1``); elsewhere it starts once the workers have
      trained ``LONG_RUN_HELPERS_AFTER_S`` (``DeferredPreemptionCallback``).
    """

    def __init__(
        self,
        *args: Any,
        prometheus: bool = False,
        private_ray: bool = False,
        sole_run: bool = False,
        signals_handled: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._signals_handled = signals_handled
        self._prometheus = prometheus
        self._private_ray = private_ray
        self._sole_run = sole_run
        # Read as Ray Train's controller reads it (``1`` / ``true``).
        self._preemption_watcher = ray_constants.env_bool(
            ENABLE_PREEMPTION_WATCHER_ENV_VAR,
            DEFAULT_ENABLE_PREEMPTION_WATCHER and not private_ray,
        )

    def _create_default_callbacks(self) -> list[Any]:
        from ray.train.v2._internal.callbacks import DatasetsCallback
        from ray.train.v2._internal.callbacks.metrics import (
            ControllerMetricsCallback,
            WorkerMetricsCallback,
        )
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback,
        )

        # mypy sees Train V1's TorchTrainer; Ray 2.60 exports V2's, which has this method.
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        dropped: tuple[type, ...] = () if self.datasets else (DatasetsCallback,)
        state_api = ray_local.state_api_running()  # looked up here: tests replace it
        if self._sole_run or not state_api:
            dropped += (PlacementGroupCleanerCallback,)
        if not state_api and not self._prometheus:
            dropped += (ControllerMetricsCallback, WorkerMetricsCallback)
        kept = [c for c in callbacks if not isinstance(c, dropped)]
        if self._preemption_watcher:
            kept.append(DeferredPreemptionCallback())
        return kept

    def _register_sigint_handler(self, controller: Any) -> None:
        """Ray Train's Ctrl-C handler aborts the run, losing the steps since the last
        checkpoint; with ``signals_handled`` the launcher's (``convoy.launchers.ray_stop``)
        stays in its place, and the workers save the step they finish."""
        if not self._signals_handled:
            super()._register_sigint_handler(controller)  # type: ignore[misc]

    def _initialize_and_run_controller(self, **controller_kwargs: Any) -> Any:
        policy = controller_kwargs["scaling_policy"]
        if type(policy) is FixedScalingPolicy:
            fixed = (
                NoAutoscalerScalingPolicy if self._private_ray else UnblockedRequestsScalingPolicy
            )
            controller_kwargs["scaling_policy"] = fixed(policy.scaling_config)
        # The controller reads this when it starts (Ray Train passes the driver's RAY_TRAIN_*
        # variables to it): its own watcher, started with the workers, is replaced by the
        # deferred one above.
        with set_env(ENABLE_PREEMPTION_WATCHER_ENV_VAR, "0"):
            return super()._initialize_and_run_controller(**controller_kwargs)  # type: ignore[misc]


@contextlib.contextmanager
def set_env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block, then as it was."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was


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
