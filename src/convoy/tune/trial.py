"""What runs inside Ray Tune: the trial function, the ASHA variant and the progress lines.

Imported only once Ray is in use (``convoy.tune.sweep`` imports it lazily): everything here
subclasses or calls Ray Tune.
"""

from __future__ import annotations

import sys
from typing import Any

from ray.tune import Callback
from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

from convoy.launchers.base import default_entry
from convoy.launchers.ray import build_trainer, prepare_on_cluster
from convoy.launchers.ray_failures import fit
from convoy.launchers.ray_local import on_private_ray
from convoy.outputs import write_config
from convoy.preflight import resolve_tracking
from convoy.tune.space import job_with, set_field


def run_trial(config: dict[str, Any], recipe: dict[str, Any]) -> None:
    """One trial, as Ray Tune calls it: a Convoy run named after the trial id, fitted by Ray
    Train with every report handed to Tune. Runs in the trial's driver actor."""
    import ray  # the ray extra
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    # Inside a Tune function: ray.tune.get_context (ray.train.* refuses to run here). The
    # run is named after the trial id, so a re-launched trial finds its Ray Train state.
    trial_id = tune.get_context().get_trial_id()
    job = job_with(set_field(recipe, "run.name", trial_id), config)
    job = resolve_tracking(job, say=False)  # the sweep's preflight said it once
    job = prepare_on_cluster(ray, job)
    write_config(job)
    # The recipe's own entry: a recipe with a ``lightning:`` section trains its LightningModule.
    trainer = build_trainer(
        job,
        entry=default_entry(job),
        callbacks=(TuneReportCallback(),),
        private_ray=on_private_ray(),
    )
    fit(trainer, job)


def trial_dirname(trial: Any) -> str:
    """Tune's own per-trial folder (``tune/<trial id>``), beside the run ``<trial id>``."""
    return str(trial.trial_id)


class FinishingASHA(AsyncHyperBandScheduler):
    """ASHA that lets a trial finish once it has trained every epoch.

    Tune's ASHA stops a trial whose ``time_attr`` reaches ``max_t``, and may stop it at a rung
    equal to ``max_t``. After its last epoch's report a trial has only its test evaluation
    and final checkpoint left: stopping it there saves nothing and loses its test metrics and
    ``summary.json``. Its result still counts in the rung, for the trials after it.
    """

    def __init__(self, *, stops_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The table tells ASHA's stops from trials an interruption ended: a file, as the
        # scheduler restored by --resume is the one pickled when the sweep started.
        self.stops_file = stops_file

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        time_attr, metric = self._time_attr, self._metric
        if time_attr in result and metric in result and result[time_attr] >= self._max_t:
            bracket = self._trial_info[trial.trial_id]
            bracket.on_result(trial, result[time_attr], self._metric_op * result[metric])
            return str(TrialScheduler.CONTINUE)
        decision = str(super().on_trial_result(tune_controller, trial, result))
        if decision == str(TrialScheduler.STOP):
            with open(self.stops_file, "a") as stops:
                stops.write(f"{trial.trial_id}\n")
        return decision


class SweepProgress(Callback):
    """One line per trial epoch and per trial end, in place of Tune's status tables."""

    def __init__(self, metric: str, epochs: int) -> None:
        self.metric = metric
        self.epochs = epochs
        self.shown: dict[str, int] = {}

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        epoch = int(result.get("epoch", 0))
        if epoch <= self.shown.get(trial.trial_id, 0) or self.metric not in result:
            return
        self.shown[trial.trial_id] = epoch
        print(
            f"convoy: trial {trial.trial_id} epoch {epoch}/{self.epochs}: "
            f"{self.metric} {result[self.metric]:.4f}",
            flush=True,
        )

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        epoch = self.shown.get(trial.trial_id, 0)
        how = "trained every epoch" if epoch >= self.epochs else f"stopped after epoch {epoch}"
        print(f"convoy: trial {trial.trial_id} {how}", flush=True)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        print(f"convoy: trial {trial.trial_id} failed (its error is in the table)", file=sys.stderr)
