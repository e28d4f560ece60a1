"""Live monitoring and the event stream on real workers: a slowed rank is named a straggler,
every epoch reaches Ray Train as a report, and the per-rank figures are Prometheus metrics
at the node's metrics endpoint while the run goes on."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import convoy
from convoy.config import Job, load_job
from convoy.outputs import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.ray_dashboard]
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SLOW_RANK_1 = ("fault.kind=slow", "fault.rank=1", "fault.slow_seconds=0.04", "fault.at_step=1")


def digits_job(tmp_path: Path, name: str, launcher: str, *extra: str) -> Job:
    return load_job(
        RECIPES / "digits_mlp.yaml",
        [
            f"scaling.launcher={launcher}",
            "scaling.num_workers=2",
            "run.epochs=2",
            "run.log_every_steps=5",
            "run.progress=plain",
            "tracking.tensorboard=false",
            f"run.storage_dir={tmp_path}",
            f"run.name={name}",
            *extra,
        ],
    )


def test_a_slowed_rank_is_named_a_straggler_in_the_log_and_metrics(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = digits_job(tmp_path, "straggler", "torchrun", *SLOW_RANK_1)
    convoy.train(job)
    log = capfd.readouterr().out
    named = [line for line in log.splitlines() if "straggler" in line]
    # Named once when it appears (the log does not repeat it at every logged step).
    assert len(named) == 1, log
    assert "rank 1 takes" in named[0] and "% slower" in named[0]
    records = [r for r in read_metrics(job.run_dir) if r["kind"] == "straggler"]
    assert records and {r["rank"] for r in records} == {1}
    for record in records:
        assert record["local_seconds"] > record["median_local_seconds"] + 0.02
        assert record["slower_by"] > job.monitor.straggler_margin
    steps = [r for r in read_metrics(job.run_dir) if r["kind"] == "step"]
    # Every logged step carries every rank's local work; the slowed rank's is the larger.
    assert all(len(r["rank_local_seconds"]) == 2 for r in steps)
    assert all(r["rank_local_seconds"][1] > r["rank_local_seconds"][0] for r in steps)


class ReportLog:
    """A Ray Train ``UserCallback`` that appends every consolidated report (all ranks'
    metrics) to a JSON-lines file; it runs in the controller, so it writes a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"metrics": metrics, "checkpoint": checkpoint is not None}) + "\n")

    def after_exception(self, run_context: Any, worker_exceptions: Any) -> None:
        pass


@pytest.mark.ray
def test_a_ray_run_reports_every_epoch_in_order_and_exports_per_rank_metrics(
    tmp_path: Path,
    ray_session,  # type: ignore[no-untyped-def]
) -> None:
    """One Ray run (rank 1 slowed): Ray Train receives every epoch, checkpoint and the end, in
    order, from every rank; the node's metrics endpoint serves each rank's figures while the
    run goes on."""
    import ray
    from ray import cloudpickle
    from ray.train import UserCallback

    from convoy.launchers.ray import build_trainer
    from convoy.launchers.ray_failures import fit
    from convoy.outputs import write_config

    port = ray._private.worker._global_node.metrics_export_port
    assert port and port > 0, "this Ray exports no metrics (ray[default] is needed)"
    # The callback is pickled into the controller actor, which cannot import this test file.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    log = tmp_path / "report-log.jsonl"
    callback = type("ReportLogCallback", (ReportLog, UserCallback), {})(log)
    job = digits_job(
        tmp_path, "watched", "ray", "run.epochs=4", "scaling.cpus_per_worker=0.5",
        "checkpoint.every_epochs=2", "monitor.prometheus=true", *SLOW_RANK_1,
    )  # fmt: skip
    write_config(job)
    with scraping(port, job.run.name or "") as seen:
        fit(build_trainer(job, callbacks=(callback,)), job)

    reports = [json.loads(line) for line in log.read_text().splitlines()]
    # epochs 1, 2, the epoch-2 checkpoint, 3, 4, the final checkpoint, the end.
    assert [r["metrics"][0]["epoch"] for r in reports] == [1, 2, 2, 3, 4, 4, 4], reports
    assert [r["checkpoint"] for r in reports] == [False, False, True, False, False, True, False]
    assert all(len(r["metrics"]) == 2 for r in reports)  # every rank reported each one
    epoch_records = [r for r in read_metrics(job.run_dir) if r["kind"] == "epoch"]
    epoch_reports = [r for r in reports if not r["checkpoint"]][:4]
    for report, record in zip(epoch_reports, epoch_records, strict=True):
        # Rank 0 reports the all-rank aggregates Convoy computed (the same as metrics.jsonl).
        assert report["metrics"][0]["val/acc"] == record["val/acc"]
        assert report["metrics"][0]["train/loss"] == record["train/loss"]
    final = reports[-1]["metrics"][0]
    assert final["done"] is True and "test/acc" in final

    for rank in ("0", "1"):
        for name in ("step_seconds", "data_wait_seconds", "local_seconds", "memory_bytes"):
            assert f"ray_convoy_{name}/rank={rank}" in seen, sorted(seen)
    assert "ray_convoy_train_loss/rank=0" in seen
    # The slowed rank was counted as a straggler (tagged with the straggling rank).
    assert "ray_convoy_stragglers_total/rank=1" in seen, sorted(seen)


@contextlib.contextmanager
def scraping(port: int, run: str) -> Iterator[dict[str, str]]:
    """Scrape ``/metrics`` every half second while the block runs; yields what was seen, by
    ``<metric>/rank=<r>``, for this run's series."""
    seen: dict[str, str] = {}
    running = threading.Event()
    running.set()

    def scrape() -> None:
        while running.is_set():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
            except OSError:
                text = b""
            for line in text.decode().splitlines():
                if line.startswith("ray_convoy_") and f'run="{run}"' in line:
                    seen.setdefault(line.split("{")[0] + _rank_tag(line), line)
            time.sleep(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        yield seen
    finally:
        running.clear()
        scraper.join()


def _rank_tag(line: str) -> str:
    for part in line.split("{", 1)[1].split(","):
        if part.startswith("rank="):
            return "/rank=" + part.split("=", 1)[1].strip('"}')
    return ""
