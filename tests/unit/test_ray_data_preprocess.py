"""The ray_data loader's preprocessing gives exactly the torch loader's samples (no Ray needed:
``Preprocess`` is what ``map_batches`` calls), and eval rows are cut exactly once per rank."""

from __future__ import annotations

import functools
import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from convoy.config import DataConfig
from convoy.data.base import TensorImageDataset
from convoy.data.convert import convert_dataset
from convoy.data.encoded import EncodedImageDataset
from convoy.data.parquet import COLUMNS
from convoy.data.ray_data import eval_rows_per_rank
from convoy.data.ray_data_stages import Preprocess, ReadRowGroups, raw_rows_only
from convoy.data.registry import load_splits
from convoy.data.shards import ShardedSplit, list_shards, scan_shards
from convoy.errors import DataError


def test_array_rows_match_the_torch_dataset() -> None:
    splits = load_splits(DataConfig(name="digits"))
    dataset = splits.test
    assert isinstance(dataset, TensorImageDataset)
    preprocess = Preprocess(
        "array",
        8,
        tuple(dataset.mean.flatten().tolist()),
        tuple(dataset.std.flatten().tolist()),
        dataset.scale,
    )
    batch = {
        "index": np.arange(5),
        "image": dataset.images[:5].numpy(),
        "label": dataset.labels[:5].numpy(),
    }
    out = preprocess(batch)
    expected = torch.stack([dataset[i][0] for i in range(5)])
    assert torch.equal(torch.from_numpy(out["x"]), expected)  # bit for bit
    assert out["y"].tolist() == dataset.labels[:5].tolist()


def png_bytes(value: int) -> bytes:
    """A 2x2 PNG of one grey level."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2), (value,) * 3).save(out, format="PNG")
    return out.getvalue()


NO_TORCH_BATCHES = {
    # digits' rows: scaled by 1/16, normalized by mean 0.5 and std 0.25: (8/16 - 0.5) / 0.25
    "array": (
        Preprocess("array", 2, (0.5,), (0.25,), 1 / 16),
        {"image": np.full((3, 1, 2, 2), 8, np.uint8)},
        "(3, 1, 2, 2) 0.0",
    ),
    # an image folder's rows (its files' bytes here): decoded to RGB in [-1, 1]
    "encoded": (
        Preprocess("encoded", 2),
        {"name": np.array(["a", "b", "c"], object), "image": np.array([png_bytes(255)] * 3)},
        "(3, 3, 2, 2) 1.0",
    ),
}


def run_in_a_fresh_interpreter(stage: Any, batch: dict[str, np.ndarray]) -> str:
    """The map stage ``stage`` run on ``batch`` in a new Python, as a Ray Data task worker is
    one: the samples' dtype, layout, shape and largest value, and whether torch was loaded."""
    probe = (
        "import pickle, sys\n"
        "stage, batch = pickle.loads(sys.stdin.buffer.read())\n"
        "x = stage(batch)['x']\n"
        "print(x.dtype, x.flags['C_CONTIGUOUS'], x.shape, float(x.max()), 'torch' in sys.modules)"
    )
    blob = pickle.dumps((stage, batch))
    done = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


@pytest.mark.parametrize("kind", sorted(NO_TORCH_BATCHES))
def test_without_augmentation_an_in_memory_source_is_preprocessed_without_torch(kind: str) -> None:
    """A Ray Data task of digits (array rows) or an image folder (encoded rows), without
    augmentation, scales or decodes in numpy and Pillow: the task's process imports no torch
    (about 1.5 CPU-s a task worker)."""
    preprocess, rows, expected = NO_TORCH_BATCHES[kind]
    batch = {**rows, "index": np.arange(3), "label": np.arange(3)}
    assert run_in_a_fresh_interpreter(preprocess, batch) == f"float32 True {expected} False"


def test_encoded_image_shards_are_read_and_decoded_without_torch(
    imagefolder: Path, tmp_path: Path
) -> None:
    """A parquet conversion of an image folder: the Ray Data task that reads a row group and
    decodes its images unpickles the split and imports no torch."""
    convert_dataset(imagefolder, tmp_path / "shards")
    location = str(tmp_path / "shards")
    groups, _ = scan_shards(location, list_shards(location, "train"))
    split = ShardedSplit(location, groups, list(COLUMNS), raw_rows_only, "label")
    read = ReadRowGroups(split, Preprocess("encoded", 8))
    batch = {"position": np.array([0]), "lo": np.array([1]), "hi": np.array([4])}
    # rows 1-3 of the dark class (levels 31-33 of 255, scaled to [-1, 1])
    assert (
        run_in_a_fresh_interpreter(read, batch)
        == "float32 True (3, 3, 8, 8) -0.7411764860153198 False"
    )


def test_encoded_rows_match_the_torch_dataset(imagefolder: Path) -> None:
    dataset = load_splits(DataConfig(name="imagefolder", path=str(imagefolder))).val
    assert isinstance(dataset, EncodedImageDataset)
    records = dataset.records[:4]
    batch = {
        "index": np.arange(4),
        "name": np.array([r.name for r in records]),
        "path": np.array([str(r.path) for r in records]),
        "label": np.array([r.label for r in records]),
    }
    out = Preprocess("encoded", 32)(batch)
    expected = torch.stack([dataset[i][0] for i in range(4)])
    assert torch.equal(torch.from_numpy(out["x"]), expected)
    assert set(out) == {"index", "x", "y"}  # no bytes, paths or names leave


def test_an_unreadable_row_names_its_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    batch = {"index": np.arange(1), "name": np.array([str(bad)]), "path": np.array([str(bad)]),
             "label": np.zeros(1, dtype=np.int64)}  # fmt: skip
    with pytest.raises(DataError, match=r"bad\.png: not an image Pillow can identify"):
        Preprocess("encoded", 8)(batch)


def test_augmentation_is_seeded_by_the_rows_of_the_batch() -> None:
    images = np.random.default_rng(0).integers(0, 255, (6, 3, 8, 8)).astype(np.uint8)
    preprocess = Preprocess("array", 8, crop_padding=2, flip=True, seed=3)

    def run(indices: list[int]) -> np.ndarray:
        batch = {"index": np.array(indices), "image": images, "label": np.zeros(6)}
        return preprocess(batch)["x"]

    assert np.array_equal(run([0, 1, 2, 3, 4, 5]), run([0, 1, 2, 3, 4, 5]))
    assert not np.array_equal(run([0, 1, 2, 3, 4, 5]), run([5, 4, 3, 2, 1, 0]))


@pytest.mark.parametrize(
    ("size", "world", "expected"),
    [(359, 2, [180, 179]), (10, 4, [3, 3, 3, 1]), (1, 3, [1, 0, 0]), (6, 3, [2, 2, 2])],
)
def test_eval_rows_cover_the_split_once(size: int, world: int, expected: list[int]) -> None:
    assert eval_rows_per_rank(size, world) == expected
    assert sum(expected) == size


def test_finished_samples_become_the_same_tensor_rows() -> None:
    """Token sequences (computed per item) and sensor series (a TensorDataset) pass through
    as the torch loader's collate would stack them."""
    from convoy.data.ray_data import sample_arrays

    text = load_splits(DataConfig(name="text", tokenizer="bytes", seq_len=16)).val
    rows = range(3, len(text))  # the last sequence is the padded one
    inputs, targets = sample_arrays(text, rows)
    assert inputs.dtype == np.int64 and inputs.shape == (len(rows), 16)
    for i, row in enumerate(rows):
        assert np.array_equal(inputs[i], text[row][0].numpy())
        assert np.array_equal(targets[i], text[row][1].numpy())
    assert (targets[-1] == -100).any()
    series = load_splits(DataConfig(name="basicmotions")).test
    x, y = sample_arrays(series, range(5, 9))
    assert np.array_equal(x, np.stack([series[i][0].numpy() for i in range(5, 9)]))
    assert y.tolist() == [int(series[i][1]) for i in range(5, 9)]


def test_too_small_an_in_memory_split_names_the_batch_not_row_groups() -> None:
    from convoy.config import load_job
    from convoy.data.ray_data_stages import ReadChunks, TrainUnits
    from convoy.data.ray_data_worker import RayTrainBatches

    job = load_job(None, ["data.batch_size=64"])
    units = TrainUnits(rows=[10, 10, 10], items=[{"position": p} for p in range(3)],
                       read=ReadChunks((), Preprocess("tensor")), window=1)  # fmt: skip
    with pytest.raises(DataError, match=r"^data.batch_size: the train split's 30 rows") as caught:
        RayTrainBatches(units, job, micro_batch=32, world_size=2, rank=0)
    assert "\n" not in str(caught.value) and "row group" not in str(caught.value)


def test_every_workers_actor_pool_fits_in_the_reservation() -> None:
    """Each train worker runs its own pipeline: their pools share the actors' half."""
    from convoy.config import load_job
    from convoy.data.ray_data import cpu_shares

    job = load_job(None, ["data.ray_data.compute=actors", "data.ray_data.reserved_cpus=2",
                          "data.ray_data.concurrency=2"])  # fmt: skip
    assert cpu_shares(job) == (1.0, 0.5)
    for workers in (2, 4):
        task_cpus, actor_cpus = cpu_shares(job, pipelines=workers)
        assert actor_cpus * 2 * workers == pytest.approx(1.0) and task_cpus == 1.0


def test_what_ray_trains_controller_unpickles_of_a_ray_data_run_imports_no_torch() -> None:
    """Ray Train's controller unpickles the run's config (the train units with their map
    stage) and its eval datasets (whose plans name the map stage's function) and runs
    neither: torch would be its dearest import. Run in a fresh interpreter."""
    from convoy.data.ray_data_stages import ReadChunks, TrainUnits, run_transform

    preprocess = Preprocess("array", 8, (0.5,), (0.25,), 1 / 16, crop_padding=1, flip=True)
    units = TrainUnits(rows=[4], items=[{"position": 0}], read=ReadChunks((), preprocess),
                       window=1)  # fmt: skip
    blob = pickle.dumps({"train": units, "map": functools.partial(run_transform, preprocess)})
    probe = (
        "import pickle, sys\n"
        "loaded = pickle.loads(sys.stdin.buffer.read())\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('convoy.data.')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "['convoy.data.ray_data_stages']"


@pytest.mark.parametrize("user_config", [False, True])
def test_ray_data_notes_leave_the_console_unless_the_user_configured_its_logging(
    user_config: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray Data's console handler is raised to warnings (its file handler untouched); under a
    ``RAY_DATA_LOGGING_CONFIG`` of the user's, its handlers are left as they are."""
    import logging

    import ray.data

    from convoy.data.ray_data import keep_ray_data_notes_off_the_terminal

    handlers = logging.getLogger("ray.data").handlers
    before = [(handler, handler.level) for handler in handlers]
    context = ray.data.DataContext.get_current()
    monkeypatch.setattr(context, "use_ray_tqdm", True)
    if user_config:
        monkeypatch.setenv("RAY_DATA_LOGGING_CONFIG", "/a/users/logging.yaml")
    try:
        keep_ray_data_notes_off_the_terminal()
        console = [h for h in handlers if type(h).__name__ == "PlainRayHandler"]
        files = [h for h in handlers if type(h).__name__ == "SessionFileHandler"]
        assert console and files
        # (an earlier run in this process may have raised it already: compared with before)
        expected = [dict(before)[h] if user_config else logging.WARNING for h in console]
        assert [h.level for h in console] == expected
        assert all(h.level == dict(before)[h] for h in files)
        assert context.use_ray_tqdm is False
    finally:
        for handler, level in before:
            handler.setLevel(level)
