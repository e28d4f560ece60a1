"""Live monitoring and the event stream on real workers: a slowed rank is named a straggler,
every epoch reaches Ray Train as a report, and the per-rank figures are Prometheus metrics
at the node's metrics endpoint while the run goes on."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import convoy
from convoy.config import Job, load_job
from convoy.outputs import read_metrics

pytestmark = [pytest.mark.e2e]
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
def test_every_epoch_and_checkpoint_reaches_ray_train_in_order(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    from ray import cloudpickle
    from ray.train import UserCallback

    from convoy.launchers.ray import build_trainer, fit
    from convoy.outputs import write_config

    # The callback is pickled into the controller actor, which cannot import this test file.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    callback = type("ReportLogCallback", (ReportLog, UserCallback), {})(
        tmp_path / "report-log.jsonl"
    )
    job = digits_job(
        tmp_path, "reports", "ray", "run.epochs=3", "scaling.cpus_per_worker=0.5",
        "checkpoint.every_epochs=2",
    )  # fmt: skip
    write_config(job)
    fit(build_trainer(job, callbacks=(callback,)), job)
    reports = [
        json.loads(line) for line in (tmp_path / "report-log.jsonl").read_text().splitlines()
    ]
    # epoch 1, epoch 2, the epoch-2 checkpoint, epoch 3, the final checkpoint, the end.
    epochs = [r["metrics"][0]["epoch"] for r in reports]
    assert epochs == [1, 2, 2, 3, 3, 3], reports
    assert [r["checkpoint"] for r in reports] == [False, False, True, False, True, False]
    assert all(len(r["metrics"]) == 2 for r in reports)  # every rank reported each one
    epoch_records = [r for r in read_metrics(job.run_dir) if r["kind"] == "epoch"]
    for report, record in zip([reports[0], reports[1], reports[3]], epoch_records, strict=True):
        # Rank 0 reports the all-rank aggregates Convoy computed (the same as metrics.jsonl).
        assert report["metrics"][0]["val/acc"] == record["val/acc"]
        assert report["metrics"][0]["train/loss"] == record["train/loss"]
    final = reports[-1]["metrics"][0]
    assert final["done"] is True and "test/acc" in final


@pytest.mark.ray
def test_per_rank_figures_are_scraped_from_the_metrics_endpoint_during_a_run(
    tmp_path: Path,
    ray_session,  # type: ignore[no-untyped-def]
) -> None:
    import ray

    port = ray._private.worker._global_node.metrics_export_port
    assert port and port > 0, "this Ray exports no metrics (ray[default] is needed)"
    job = digits_job(
        tmp_path, "scraped", "ray", "run.epochs=6", "scaling.cpus_per_worker=0.5", *SLOW_RANK_1
    )
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
                if line.startswith("ray_convoy_") and 'run="scraped"' in line:
                    seen.setdefault(line.split("{")[0] + _rank_tag(line), line)
            time.sleep(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        convoy.train(job)
    finally:
        running.clear()
        scraper.join()
    for rank in ("0", "1"):
        for name in ("step_seconds", "data_wait_seconds", "local_seconds", "memory_bytes"):
            assert f"ray_convoy_{name}/rank={rank}" in seen, sorted(seen)
    assert "ray_convoy_train_loss/rank=0" in seen
    # The slowed rank was counted as a straggler (tagged with the straggling rank).
    assert "ray_convoy_stragglers_total/rank=1" in seen, sorted(seen)


def _rank_tag(line: str) -> str:
    for part in line.split("{", 1)[1].split(","):
        if part.startswith("rank="):
            return "/rank=" + part.split("=", 1)[1].strip('"}')
    return ""
