"""Ray Train's ``TorchTrainer`` for Convoy's runs, without the helpers a run does not need.

Imported by the ``ray`` launcher in the driver only; what Ray Train's controller runs (the
process group's backend, the scaling policies, the deferred preemption watcher) is in
``convoy.launchers.ray_controller``, which imports no torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import ray._private.ray_constants as ray_constants
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.constants import (
    DEFAULT_ENABLE_PREEMPTION_WATCHER,
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
)
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

from convoy.launchers import ray_local
from convoy.launchers.ray_controller import (
    DeferredPreemptionCallback,
    NoAutoscalerScalingPolicy,
    UnblockedRequestsScalingPolicy,
)


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
