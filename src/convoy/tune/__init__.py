"""``convoy tune``: hyperparameter sweeps over any recipe field, Ray Tune over Ray Train V2.

Files, by idea:

- ``space``: the search-space YAML (dotted fields, one kind each), checked against the
  recipe through the same ``Job`` validation recipes get; no Ray;
- ``sweep``: the checks before Ray starts (``plan_sweep``), then the ``Tuner`` on Ray
  (``run_sweep``), with trial drivers on a custom resource and resumable sweeps;
- ``trial``: what runs inside Tune (the trial function, ASHA on epochs, progress lines);
- ``results``: the ranked table, ``best.yaml``, ``results.json`` and the trials' report.
"""

from __future__ import annotations

from convoy.tune.space import KINDS, SEARCHES, Dim, SpaceError, load_space, parse_space
from convoy.tune.sweep import TRIAL_DRIVER, Sweep, SweepError, plan_sweep, run_sweep

__all__ = [
    "KINDS",
    "SEARCHES",
    "TRIAL_DRIVER",
    "Dim",
    "SpaceError",
    "Sweep",
    "SweepError",
    "load_space",
    "parse_space",
    "plan_sweep",
    "run_sweep",
]
