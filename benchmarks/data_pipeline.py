"""Data pipeline on CPU: Ray Data against DataLoader on the same generated JPEG/PNG tree.

1. Throughput of decode + resize + augment (random shift, flip), images/s, with no training:
   a DataLoader over Convoy's ``EncodedImageDataset`` with ``num_workers`` = the machine's
   cores, and Convoy's Ray Data train pipeline (shuffle + ``map_batches``) as tasks and as an
   actor pool, read with ``iter_torch_batches``. Each is read twice; the second pass is timed
   (the first starts worker processes).
2. Training side by side: the same recipe (``vit_tiny`` on the tree, ``ddp`` x 2 on an
   embedded Ray) with ``data.loader: torch`` and ``ray_data``, interleaved; the summary's
   data-wait fraction (time in ``next(batch)`` over step time) and samples/s.

    python benchmarks/data_pipeline.py [--images 3000] [--repeats 2] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import convoy
from convoy.config import load_job
from convoy.data.registry import load_splits

REPO = Path(__file__).resolve().parents[1]
CLASSES = 10


def make_tree(root: Path, images: int, size: int = 64) -> Path:
    """``images`` noisy images in 10 classes (class = a colour shift), half JPEG, half PNG."""
    from PIL import Image

    rng = np.random.default_rng(0)
    per_class = images // CLASSES
    for split, count in (("train", per_class), ("val", max(1, per_class // 5))):
        for label in range(CLASSES):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 200, (size, size, 3)).astype(np.float32)
                pixels[..., label % 3] += 25 * (label // 3 + 1)
                image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
                image.save(folder / f"{i:05d}.{'jpg' if i % 2 else 'png'}")
    return root


def data_overrides(tree: Path) -> list[str]:
    return [
        "data.name=imagefolder",
        f"data.path={tree}",
        "data.image_size=32",
        "data.augment_crop_padding=4",
        "data.augment_flip=true",
        "data.batch_size=128",
    ]


def dataloader_rate(tree: Path) -> float:
    job = load_job(None, data_overrides(tree))
    dataset = load_splits(job.data).train
    workers = os.cpu_count() or 1
    loader = DataLoader(dataset, batch_size=128, shuffle=True, num_workers=workers,  # type: ignore[arg-type]
                        persistent_workers=True)  # fmt: skip
    for _ in loader:  # first pass: starts the worker processes
        pass
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    return count / (time.perf_counter() - start)


def ray_data_rate(tree: Path, compute: str) -> float:
    from convoy.data.ray_data import build_ray_data
    from convoy.data.ray_data_worker import units_dataset

    job = load_job(
        None,
        [
            *data_overrides(tree),
            "scaling.launcher=ray",
            "scaling.num_workers=1",
            "data.loader=ray_data",
            f"data.ray_data.compute={compute}",
            # Nothing trains here: the pipeline may use every core.
            f"data.ray_data.reserved_cpus={os.cpu_count()}",
            *(["data.ray_data.concurrency=2"] if compute == "actors" else []),
        ],
    )
    units = build_ray_data(job, world_size=1).train
    train = units_dataset(units, list(range(len(units.rows))), job, seed=0)
    for _ in train.iter_torch_batches(batch_size=128):  # first pass: starts tasks/actors
        pass
    start = time.perf_counter()
    count = sum(len(batch["y"]) for batch in train.iter_torch_batches(batch_size=128))
    return count / (time.perf_counter() - start)


def train_once(tree: Path, loader: str, root: Path, repeat: int) -> dict[str, float]:
    job = load_job(
        None,
        [
            *data_overrides(tree),
            "model.name=vit_tiny",
            "strategy.name=ddp",
            "scaling.launcher=ray",
            "scaling.num_workers=2",
            "scaling.cpus_per_worker=0.5",
            f"data.loader={loader}",
            f"data.num_workers={1 if loader == 'torch' else 0}",
            "run.epochs=2",
            "run.progress=off",
            f"run.storage_dir={root}",
            f"run.name={loader}-{repeat}",
        ],
    )
    summary = convoy.train(job).summary
    return {
        "data_wait": summary["data_wait_fraction"],
        "samples_per_second": summary["samples_per_second"],
        "test_acc": summary["metrics"]["test/acc"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    with tempfile.TemporaryDirectory(prefix="convoy-data-") as tmp:
        tree = make_tree(Path(tmp) / "tree", args.images)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
                 logging_config=ray.LoggingConfig(log_level="ERROR"))  # fmt: skip
        rates: dict[str, list[float]] = {"DataLoader": [], "Ray Data (tasks)": [],
                                         "Ray Data (actors x 2)": []}  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {"torch": [], "ray_data": []}
        for repeat in range(args.repeats):  # interleaved, so drift hits both alike
            rates["DataLoader"].append(dataloader_rate(tree))
            rates["Ray Data (tasks)"].append(ray_data_rate(tree, "tasks"))
            rates["Ray Data (actors x 2)"].append(ray_data_rate(tree, "actors"))
            for loader in runs:
                runs[loader].append(train_once(tree, loader, Path(tmp) / "runs", repeat))
        ray.shutdown()
    base = statistics.median(rates["DataLoader"])
    rate_rows = [
        f"| {name} | {statistics.median(values):,.0f} | {statistics.median(values) / base:.2f} |"
        for name, values in rates.items()
    ]
    rate_table = "\n".join(
        ["| pipeline | images/s (median) | vs DataLoader |", "|---|---|---|", *rate_rows]
    )
    train_rows = [
        f"| {loader} | {100 * statistics.median(r['data_wait'] for r in results):.1f}% "
        f"| {statistics.median(r['samples_per_second'] for r in results):,.0f} "
        f"| {statistics.median(r['test_acc'] for r in results):.3f} |"
        for loader, results in runs.items()
    ]
    train_table = "\n".join(
        [
            "| data.loader | data-wait fraction | samples/s | test acc |",
            "|---|---|---|---|",
            *train_rows,
        ]
    )
    text = f"""# Data pipeline (CPU), {date.today().isoformat()}

Produced by `python benchmarks/data_pipeline.py --images {args.images} --repeats {args.repeats}`.
Machine: {os.cpu_count()} CPU cores ({platform.machine()}), no GPU; torch {torch.__version__}.
The tree: {args.images} generated 64x64 images in 10 classes, half JPEG and half PNG, decoded,
resized to 32x32, randomly shifted (pad 4) and flipped. Medians of {args.repeats} interleaved
repetitions.

## Decode + augment throughput, no training

{rate_table}

DataLoader: `num_workers={os.cpu_count()}`, batch 128, the second pass timed. Ray Data: the
train pipeline Convoy builds (a seeded block-order shuffle, then `map_batches`), read from the
driver with `iter_torch_batches(batch_size=128)`, the second pass timed, every core
available to it.

## Training side by side

`vit_tiny` on the tree, `ddp` x 2 on an embedded Ray (0.5 CPU per train worker), 2 epochs,
global batch 128. `torch`: a DataLoader with 1 worker process in each train worker. `ray_data`:
the pipeline above, with 1 CPU reserved for it. Data wait is the time spent waiting for the
next batch over the time of the training steps.

{train_table}
"""
    out = args.out / f"data_pipeline_cpu_{date.today().isoformat()}.md"
    out.write_text(text)
    print(rate_table)
    print()
    print(train_table)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
