"""The per-machine cache of derived data: the bundled datasets decoded once, read after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_diabetes as sklearn_diabetes
from sklearn.datasets import load_digits as sklearn_digits

from convoy.config import load_job
from convoy.data.cache import cached_arrays
from convoy.data.sources import load_digits
from convoy.data.tabular import load_diabetes


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(folder))
    return folder


def test_arrays_are_computed_once_then_read(cache: Path) -> None:
    calls = []

    def compute() -> dict[str, np.ndarray]:
        calls.append(1)
        return {"x": np.arange(6).reshape(2, 3), "names": np.array(["a", "bc"])}

    first = cached_arrays("things", {"k": 1}, compute)
    second = cached_arrays("things", {"k": 1}, compute)
    assert len(calls) == 1
    assert np.array_equal(first["x"], second["x"]) and second["x"].shape == (2, 3)
    assert second["names"].tolist() == ["a", "bc"]
    cached_arrays("things", {"k": 2}, compute)  # another key: computed again
    assert len(calls) == 2
    assert len(list((cache / "things").glob("*.npz"))) == 2
    assert not list((cache / "things").glob("*.tmp*"))


def test_an_unwritable_cache_computes_in_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(blocker / "cache"))  # below a file: no folder
    arrays = cached_arrays("things", {"k": 1}, lambda: {"x": np.ones(3)})
    assert arrays["x"].tolist() == [1.0, 1.0, 1.0]


def test_cached_digits_and_diabetes_are_scikit_learns(cache: Path) -> None:
    data = load_job(None, []).data
    for _ in range(2):  # a miss, then a hit
        splits = load_digits(data)
        assert len(splits.train) + len(splits.val) + len(splits.test) == 1797
    stored = [np.load(path) for path in (cache / "datasets").glob("*.npz")]
    assert len(stored) == 1
    assert np.array_equal(stored[0]["images"], sklearn_digits().images)
    assert np.array_equal(stored[0]["target"], sklearn_digits().target)
    regression = load_job(None, ["task.name=regression", "data.name=diabetes"]).data
    for _ in range(2):
        tabular = load_diabetes(regression)
    bunch = sklearn_diabetes(scaled=False)
    assert tabular.meta["feature_names"] == list(bunch.feature_names)
    assert len(list((cache / "datasets").glob("*.npz"))) == 2


def test_a_cached_dataset_loads_without_importing_scikit_learn(cache: Path) -> None:
    load = (
        "import sys\n"
        "from convoy.config import load_job\n"
        "from convoy.data.sources import load_digits\n"
        "load_digits(load_job(None, []).data)\n"
        "print('sklearn' in sys.modules)\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", load], capture_output=True, text=True) for _ in "ab"
    ]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], [r.stderr for r in runs]
