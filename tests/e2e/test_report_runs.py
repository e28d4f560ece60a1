"""``convoy report`` on real runs: one run, then two overlaid, from the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

import convoy
from chromium import find_chromium, load_page
from convoy.cli import main
from convoy.config import load_job
from convoy.outputs import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from convoy.report import HTML_FILE, load_run
from convoy.storage import RunStorage

pytestmark = pytest.mark.e2e
pytest.importorskip("matplotlib")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"


def short_run(storage: Path, name: str, *extra: str) -> Path:
    job = load_job(
        RECIPE,
        [
            "scaling.launcher=local",
            "run.epochs=2",
            "run.max_steps=30",
            "run.log_every_steps=2",
            "run.progress=off",
            f"run.storage_dir={storage}",
            f"run.name={name}",
            *extra,
        ],
    )
    return Path(convoy.train(job).run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    storage = tmp_path_factory.mktemp("runs")
    return short_run(storage, "ddp"), short_run(storage, "single", "strategy.name=single")


def test_report_of_a_real_run(runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run = runs[0]
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    pngs = {p.stem: p for p in (run / "report").glob("*.png")}
    assert set(pngs) == {
        "train_loss", "metrics", "lr", "throughput", "step_time", "data_wait", "memory",
        "peak_memory",
    }  # fmt: skip
    for png in pngs.values():
        assert str(png) in printed
        with Image.open(png) as image:
            assert image.size[0] > 500 and image.size[1] > 200
    page = (run / "report" / HTML_FILE).read_text()
    assert page.count("data:image/png;base64,") == len(pngs)
    assert "<td>ddp</td>" in page and "test/acc" in page
    assert len(load_run(run).steps) == 15  # steps 2, 4, ..., 30


def test_two_real_runs_overlaid(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / HTML_FILE) in printed
    page = (out / HTML_FILE).read_text()
    assert "<th>ddp</th><th>single</th>" in page
    assert "<td>ddp</td><td>single</td>" in page
    assert (out / "train_loss.png").is_file() and (out / "metrics.png").is_file()


def test_a_run_on_s3_is_reported_in_the_working_directory(
    s3,  # type: ignore[no-untyped-def]
    runs: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    remote = RunStorage.at("s3://convoy/runs/s3-ddp")  # the bucket the s3 fixture creates
    for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE):
        remote.write_text(name, (runs[0] / name).read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["report", "s3://convoy/runs/s3-ddp"]) == 0
    assert "report-s3-ddp/report.html" in capsys.readouterr().out
    assert (tmp_path / "report-s3-ddp" / HTML_FILE).is_file()
    assert not remote.exists("report")


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        pytest.skip("no chromium on PATH: `make browser` installs Debian's (root, apt-get)")
    return found


def test_the_report_loads_in_a_browser_without_errors(
    runs: tuple[Path, Path], tmp_path: Path, chromium: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    capsys.readouterr()
    loaded = load_page(chromium, out / HTML_FILE)
    assert loaded.errors == []
    assert loaded.title == "Convoy report: ddp, single"
    assert len(loaded.images) == len(list(out.glob("*.png"))) >= 4
    for image in loaded.images:
        assert image["complete"] and image["width"] > 500 and image["height"] > 200, image
    assert loaded.requests == []  # nothing fetched: no network, no other file


def test_the_browser_check_sees_a_broken_page(tmp_path: Path, chromium: str) -> None:
    page = tmp_path / "broken.html"
    page.write_text(
        '<html><body><img alt="cut" src="data:image/png;base64,iVBORw0KGgo=">'
        '<img alt="away" src="missing.png"><script>console.error("boom"); nope();</script>'
        "</body></html>"
    )
    loaded = load_page(chromium, page)
    assert [i["width"] for i in loaded.images] == [0, 0]
    assert any("boom" in e for e in loaded.errors)
    assert any("nope" in e for e in loaded.errors)
    assert any("missing.png" in r for r in loaded.requests)
