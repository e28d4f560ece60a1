"""convoy data prepare-imagenet / convert / inspect on trees the tests generate, including a
corrupt image and a missing file; training from the parquet equals training from the folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import convoy
from convoy.cli import main
from convoy.config import load_job
from convoy.data.parquet import read_classes, shard_files

pytestmark = pytest.mark.e2e
CLASSES = ("cat", "dog", "owl")


def save_image(path: Path, label: int, seed: int, size: int = 12) -> None:
    """A noisy image whose mean colour channel says its class (learnable, not trivial)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size, size, 3)).astype(np.float32) * 0.6
    pixels[..., label] += 90
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path)


def make_tree(root: Path, per_class: dict[str, int]) -> Path:
    seed = 0
    for split, count in per_class.items():
        for label, name in enumerate(CLASSES):
            for i in range(count):
                suffix = ".jpg" if i % 3 == 0 else ".png"
                save_image(root / split / name / f"{i:03d}{suffix}", label, seed)
                seed += 1
    return root


def test_prepare_imagenet_builds_the_layout_reports_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = tmp_path / "ILSVRC", tmp_path / "imagenet"
    for wnid, label in (("n01440764", 0), ("n01443537", 1)):
        for i in range(2):
            save_image(src / "train" / wnid / f"{wnid}_{i}.JPEG", label, i)
    (src / "train" / "n01443537" / "n01443537_9.JPEG").write_bytes(b"not a jpeg")  # corrupt
    val = {1: "n01440764", 2: "n01443537", 3: "n01443537"}
    for i in val:
        if i != 3:  # image 3 is named by the CSV but missing
            save_image(src / "val" / f"ILSVRC2012_val_{i:08d}.JPEG", 0, 10 + i)
    save_image(src / "val" / "ILSVRC2012_val_00000099.JPEG", 0, 99)  # not in the CSV
    rows = [f"ILSVRC2012_val_{i:08d},{wnid} 1 2 30 40" for i, wnid in val.items()]
    (src / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(rows))

    assert main(["data", "prepare-imagenet", str(src), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "placed: 4 train, 2 val (0 already in place)" in out
    assert "missing (named in the CSV, not in val/): 1" in out
    assert "ILSVRC2012_val_00000003.JPEG" in out
    assert "unlabeled (in val/, not in the CSV): 1" in out
    assert "unreadable (left out): 1" in out and "n01443537_9.JPEG" in out
    layout = sorted(str(p.relative_to(dst)) for p in dst.rglob("*.JPEG"))
    assert layout == [
        "train/n01440764/n01440764_0.JPEG",
        "train/n01440764/n01440764_1.JPEG",
        "train/n01443537/n01443537_0.JPEG",
        "train/n01443537/n01443537_1.JPEG",
        "val/n01440764/ILSVRC2012_val_00000001.JPEG",
        "val/n01443537/ILSVRC2012_val_00000002.JPEG",
    ]
    report = json.loads((dst / "prepare_report.json").read_text())
    assert report["missing"] == [str(src / "val" / "ILSVRC2012_val_00000003.JPEG")]

    assert main(["data", "prepare-imagenet", str(src), str(dst)]) == 0  # again: nothing to do
    assert "placed: 0 train, 0 val (6 already in place)" in capsys.readouterr().out
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*.JPEG")) == layout


def folder_job(path: Path, name: str, storage: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_job(
        None,
        [
            f"data.name={name}",
            f"data.path={path}",
            "data.image_size=12",
            "data.batch_size=16",
            "model.name=mlp",
            "strategy.name=single",
            "scaling.launcher=local",
            "scaling.num_workers=1",
            "optim.lr=3e-3",
            "run.epochs=4",
            "run.progress=off",
            f"run.storage_dir={storage}",
            f"run.name={name}",
            *extra,
        ],
    )


def test_convert_reports_bad_files_and_parquet_trains_like_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = make_tree(tmp_path / "tree", {"train": 24, "val": 7})
    (tree / "train" / "dog" / "zz_corrupt.png").write_bytes(b"\x89PNG broken")
    (tree / "val" / "owl" / "zz_missing.png").symlink_to(tmp_path / "gone.png")
    out = tmp_path / "parquet"

    assert main(["data", "convert", str(tree), str(out), "--shard-mb", "0.01"]) == 0
    printed = capsys.readouterr().out
    assert "train: 72 images" in printed and "val: 21 images" in printed
    assert "zz_corrupt.png" in printed and "zz_missing.png (missing)" in printed
    assert read_classes(out) == list(CLASSES)
    assert len(shard_files(out / "train")) > 1  # ~10 KiB shards
    report = json.loads((out / "convert_report.json").read_text())
    assert report["splits"]["train"]["classes"] == {"cat": 24, "dog": 24, "owl": 24}

    assert main(["data", "inspect", str(out), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["layout"] == "parquet"
    assert inspected["splits"]["val"]["count"] == 21
    assert inspected["splits"]["val"]["sizes"] == {"12x12": 21}
    assert main(["data", "inspect", str(tree)]) == 0
    assert "unreadable: 1" in capsys.readouterr().out

    # The folder (skipping its two bad files) and its parquet conversion train identically.
    folder = convoy.train(folder_job(tree, "imagefolder", tmp_path, "data.on_bad_record=skip"))
    parquet = convoy.train(folder_job(out, "parquet", tmp_path))
    assert sorted(folder.summary["skipped_records"]) == [
        f"{tree / 'train' / 'dog' / 'zz_corrupt.png'} (not an image Pillow can identify)",
        f"{tree / 'val' / 'owl' / 'zz_missing.png'} (missing)",
    ]
    assert parquet.summary["skipped_records"] == []
    assert folder.summary["metrics"]["test/acc"] > 0.6  # three classes: chance is 0.33
    assert parquet.summary["metrics"] == folder.summary["metrics"]


def test_cifar10_converts_to_parquet_and_trains(
    cifar_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cifar-parquet"
    assert main(["data", "convert", str(cifar_dir), str(out)]) == 0
    assert "train: 100 images" in capsys.readouterr().out  # 5 batches x 20
    assert read_classes(out)[:2] == ["airplane", "automobile"]
    summary = convoy.train(folder_job(out, "parquet", tmp_path, "data.image_size=32")).summary
    assert summary["metrics"]["test/samples"] == 20  # no test/ split in the layout: val (20%)
