"""``convoy report``: bad inputs are one-line errors; synthetic runs give a self-contained page."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from convoy.cli import main
from convoy.outputs import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, RunOutputs
from convoy.report import (
    HTML_FILE,
    build_report,
    default_out_dir,
    last_per,
    load_run,
    load_runs,
    parse_metrics,
)
from convoy.storage import RunStorage

pytest.importorskip("matplotlib")


def write_run(
    root: Path,
    name: str,
    world_size: int = 2,
    steps: int = 30,
    per_rank: bool = True,
    summary: bool = True,
    resumed_at: int | None = None,
) -> Path:
    """A run directory written by the real writer: step records every step, an epoch record
    every 10 steps, a test record; ``resumed_at`` appends a second attempt from that step."""
    run_dir = root / name
    storage = RunStorage.at(run_dir)
    storage.write_text(CONFIG_FILE, f"run:\n  name: {name}\n")
    outputs = RunOutputs(storage, enabled=True)
    starts = [1] if resumed_at is None else [1, resumed_at]
    for attempt, first in enumerate(starts):
        for step in range(first, steps + 1):
            if attempt == 0 and resumed_at is not None and step > resumed_at + 5:
                break  # the first attempt died a few steps after its checkpoint
            outputs.log(step_record(step, world_size, per_rank, loss_offset=attempt))
            if step % 10 == 0:
                outputs.log(
                    {
                        "kind": "epoch",
                        "epoch": step // 10,
                        "step": step,
                        "train/loss": 2.0 / step,
                        "train/acc": 0.5 + step / 100,
                        "val/loss": 2.2 / step,
                        "val/acc": 0.45 + step / 100,
                        "val/samples": 100,
                    }
                )
    outputs.log({"kind": "test", "step": steps, "test/loss": 0.1, "test/acc": 0.8})
    if summary:
        outputs.write_summary(
            {
                "run_name": name,
                "strategy": "ddp",
                "launcher": "torchrun",
                "world_size": world_size,
                "precision": "fp32",
                "steps": steps,
                "metrics": {"test/loss": 0.1, "test/acc": 0.8, "test/samples": 100},
                "samples_per_second": 1234.5,
                "step_seconds_median": 0.02,
                "data_wait_fraction": 0.05,
                "peak_memory_bytes_per_rank": [2**27] * world_size,
            }
        )
    return run_dir


def step_record(step: int, world_size: int, per_rank: bool, loss_offset: float = 0.0) -> dict:
    record = {
        "kind": "step",
        "step": step,
        "epoch": 1 + (step - 1) // 10,
        "train/loss": 2.0 / step + loss_offset,
        "lr": 1e-3 * min(1.0, step / 5),
    }
    if per_rank:
        slow = [0.02 + 0.01 * (rank == world_size - 1) for rank in range(world_size)]
        record.update(
            rank_step_seconds=slow,
            rank_data_wait_seconds=[0.002] * world_size,
            rank_memory_bytes=[2**26 + step * 2**16] * world_size,
            samples_per_second=1000.0 + step,
        )
    return record


def report(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["report", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_valid_report(out: Path, printed: str) -> list[Path]:
    """Every PNG is a real image, embedded in the HTML, which references nothing external."""
    page = out / HTML_FILE
    assert str(page) in printed
    pngs = sorted(out.glob("*.png"))
    assert pngs
    text = page.read_text()
    for png in pngs:
        assert str(png) in printed
        with Image.open(png) as image:
            image.verify()
            assert image.format == "PNG"
        assert base64.b64encode(png.read_bytes()).decode() in text
    assert text.count('src="data:image/png;base64,') == len(pngs)
    assert not re.search(r"(https?:)?//[\w.-]+\.\w+", text.replace("data:image/png", ""))
    assert "<script" not in text and "<link" not in text
    return pngs


def test_one_run_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path, "exp1")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    code, out, _ = report([str(run)], capsys)
    assert code == 0
    names = {p.stem for p in assert_valid_report(run / "report", out)}
    assert names == {
        "train_loss", "metrics", "lr", "throughput", "step_time", "data_wait", "memory",
        "peak_memory",
    }  # fmt: skip
    # The run's own files are untouched; only the report folder is new.
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != "report"} == before
    text = (run / "report" / HTML_FILE).read_text()
    assert "<td>ddp</td>" in text and "80.00%" in text  # the summary table


def test_overlay_of_runs_with_and_without_per_rank_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = write_run(tmp_path, "new", world_size=2)
    old = write_run(tmp_path, "old", world_size=1, per_rank=False, summary=False)
    code, out, _ = report([str(new), str(old), "--out", str(tmp_path / "cmp")], capsys)
    assert code == 0
    assert_valid_report(tmp_path / "cmp", out)
    assert "step time per rank (rank_step_seconds in step records): not recorded by old" in out
    assert "old: no summary.json" in out
    assert not (new / "report").exists()
    table = (tmp_path / "cmp" / HTML_FILE).read_text()
    assert "<th>new</th><th>old</th>" in table


def test_runs_without_per_rank_records_leave_those_figures_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, "old", per_rank=False)
    code, out, _ = report([str(run)], capsys)
    assert code == 0
    names = {p.stem for p in assert_valid_report(run / "report", out)}
    assert names == {"train_loss", "metrics", "lr", "peak_memory"}
    assert "data-wait fraction per rank (rank_data_wait_seconds in step records): not " in out
    assert "Not shown" in (run / "report" / HTML_FILE).read_text()


def test_a_report_into_an_old_report_folder_leaves_none_of_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = write_run(tmp_path, "full", world_size=2)
    old = write_run(tmp_path, "old", per_rank=False)
    out = tmp_path / "shared"
    assert report([str(full), "--out", str(out)], capsys)[0] == 0
    assert (out / "step_time.png").exists()
    code, printed, _ = report([str(old), "--out", str(out)], capsys)
    assert code == 0
    # assert_valid_report checks every PNG in the folder is this report's own.
    names = {p.stem for p in assert_valid_report(out, printed)}
    assert names == {"train_loss", "metrics", "lr", "peak_memory"}


def test_a_resumed_run_keeps_the_last_record_per_step(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "resumed", steps=30, resumed_at=20))
    assert [r["step"] for r in run.steps] == list(range(1, 31))
    assert run.steps[20]["train/loss"] == pytest.approx(2.0 / 21 + 1)  # the second attempt's
    assert [r["epoch"] for r in run.epochs] == [1, 2, 3]


def test_unreadable_lines_are_skipped_and_counted() -> None:
    records, bad = parse_metrics('{"kind": "step", "step": 1}\n[1]\n{"kind": "st\n\n')
    assert bad == 2 and records == [{"kind": "step", "step": 1}]
    assert last_per(records, "step", "step") == records


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p / "missing", "no such directory"),
        (lambda p: p, "not a run directory: no config.yaml, metrics.jsonl or summary.json"),
        (lambda p: _touch(p / "afile"), "a file, not a run directory"),
        (lambda p: _touch(p / CONFIG_FILE).parent, "metrics.jsonl is missing"),
        (lambda p: _touch(p / METRICS_FILE).parent, "metrics.jsonl holds no records"),
    ],
    ids=["missing", "not-a-run", "file", "no-metrics", "empty-metrics"],
)
def test_bad_inputs_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup, message: str
) -> None:
    target = setup(tmp_path)
    code, _, err = report([str(target)], capsys)
    assert code == 2
    assert err.startswith("convoy: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert "a run directory (<run.storage_dir>/<run.name>) holds" in err or "records" in err
    assert not (Path(target) / "report").exists() or not Path(target).is_dir()


def test_a_bad_run_among_good_ones_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_run(tmp_path, "good")
    code, _, err = report([str(good), str(tmp_path / "nope")], capsys)
    assert code == 2 and "nope: no such directory" in err
    assert not (good / "report").exists()


def test_missing_matplotlib_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = report([str(write_run(tmp_path, "exp"))], capsys)
    assert code == 2
    assert err.strip() == (
        "convoy: error: convoy report needs matplotlib (the 'plot' extra): "
        "pip install 'convoy[plot]' (in a checkout: make dev)"
    )


def test_help_names_the_default_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "<first run>/report/" in capsys.readouterr().out


def test_summary_json_is_read(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "exp"))
    assert run.summary == json.loads((tmp_path / "exp" / SUMMARY_FILE).read_text())


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def test_runs_sharing_a_name_are_told_apart_by_their_folder(tmp_path: Path) -> None:
    first, second = write_run(tmp_path / "a", "exp"), write_run(tmp_path / "b", "exp")
    assert [r.name for r in load_runs([first, second])] == ["a/exp", "b/exp"]


def test_many_ranks_are_drawn_as_a_band_with_the_slowest_named(tmp_path: Path) -> None:
    report = build_report(load_runs([write_run(tmp_path, "wide", world_size=12)]))
    assert {"step_time", "data_wait", "memory"} <= {p.name for p in report.plots}


def test_default_output_folder() -> None:
    assert default_out_dir("runs/exp1") == Path("runs/exp1/report")
    assert default_out_dir("s3://bucket/runs/exp2/") == Path("report-exp2")


def test_a_storage_dir_given_for_a_run_names_the_runs_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, "exp1")
    _touch(tmp_path / "failed" / CONFIG_FILE)  # failed before its first step: no metrics
    code, _, err = report([str(tmp_path) + "/"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not a run directory" in err and "it holds runs: exp1, failed" in err
    assert f"e.g. convoy report {tmp_path}/exp1" in err
    assert not (tmp_path / "report").exists()


def test_figure_titles_are_distinct(tmp_path: Path) -> None:
    from convoy.report import build_report

    built = build_report([load_run(write_run(tmp_path, "exp1"))])
    titles = [plot.title for plot in built.plots]
    assert len(titles) == len(set(titles)), titles
