"""Prometheus metrics of the workers under Ray, through ``ray.util.metrics``.

Each rank exports its own figures at every logged step, tagged with the run and the rank:
``convoy_step_seconds``, ``convoy_data_wait_seconds``, ``convoy_local_seconds`` (data wait +
forward, what straggler detection compares) and ``convoy_memory_bytes``; rank 0 adds the run's
``convoy_train_loss`` and ``convoy_samples_per_second``, and counts named stragglers in
``convoy_stragglers_total`` (tagged with the straggling rank). Ray serves them at each node's
metrics export port (``ray_`` prefixed) for Prometheus and Ray's Grafana dashboards.
"""

from __future__ import annotations

from typing import Any

from convoy.engine.events import Sink, StepEvent, StragglerEvent

TAG_KEYS = ("run", "rank")

PER_RANK = {
    "convoy_step_seconds": "Mean optimizer-step time of this rank since the last logged step",
    "convoy_data_wait_seconds": "Mean time this rank waited for its next batch per step",
    "convoy_local_seconds": "Mean local work per step (data wait + forward) of this rank",
    "convoy_memory_bytes": "Peak memory of this rank (allocated on GPU, resident set on CPU)",
}
RUN_WIDE = {
    "convoy_train_loss": "Mean training loss over every rank at the last logged step",
    "convoy_samples_per_second": "Global training samples per second",
}


class PrometheusSink(Sink):
    """``ray.util.metrics`` gauges and a counter, recorded on every rank."""

    name = "prometheus"

    def __init__(self, run: str, rank: int) -> None:
        from ray.util.metrics import Counter, Gauge  # the ray extra

        self.rank = rank
        self.tags = {"run": run, "rank": str(rank)}
        self.gauges: dict[str, Any] = {
            name: Gauge(name, description=text, tag_keys=TAG_KEYS)
            for name, text in {**PER_RANK, **(RUN_WIDE if rank == 0 else {})}.items()
        }
        self.stragglers = (
            Counter(
                "convoy_stragglers",
                description="Logged steps at which a rank was named a straggler",
                tag_keys=TAG_KEYS,
            )
            if rank == 0
            else None
        )

    def on_step(self, event: StepEvent) -> None:
        ranks, rank = event.ranks, self.rank
        values: dict[str, float] = {
            "convoy_step_seconds": ranks.step_seconds[rank],
            "convoy_data_wait_seconds": ranks.data_wait_seconds[rank],
            "convoy_local_seconds": ranks.local_seconds[rank],
            "convoy_memory_bytes": float(ranks.memory_bytes[rank]),
        }
        if rank == 0:
            values["convoy_train_loss"] = event.loss
            values["convoy_samples_per_second"] = event.samples_per_second
        for name, value in values.items():
            self.gauges[name].set(value, tags=self.tags)

    def on_straggler(self, event: StragglerEvent) -> None:
        if self.stragglers is not None:
            self.stragglers.inc(1.0, tags={**self.tags, "rank": str(event.rank)})
