"""``convoy data convert SRC DST --format parquet`` and ``convoy data inspect PATH``.

``convert`` turns an ImageFolder tree or CIFAR-10 pickle batches into the parquet layout the
``parquet`` source reads (see ``convoy.data.parquet``): shards of about ``shard_mb`` each,
rows ``index, image, label, name``, plus ``classes.json``. ImageFolder images keep their file
bytes and their order, so training from the parquet gives the metrics of training from the
folder; CIFAR-10 images are stored as PNG (lossless). Unreadable and missing files are left
out and reported.

``inspect`` reads any of the three layouts and reports counts, class balance, image sizes and
unreadable records.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from convoy.data.cifar10 import CLASSES as CIFAR10_CLASSES
from convoy.data.cifar10 import read_cifar10
from convoy.data.image_records import UNREADABLE, ImageRecord, unreadable_reason
from convoy.data.imagefolder import list_classes, list_files
from convoy.data.parquet import CLASSES_FILE, read_classes, read_records, shard_files
from convoy.errors import DataError

FORMAT = "convoy-parquet/1"
SPLITS = ("train", "val", "test")


@dataclass
class SplitReport:
    count: int = 0
    classes: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    """"WxH" -> images of that size."""
    unreadable: list[str] = field(default_factory=list)
    shards: int = 0


def detect_layout(src: Path) -> str:
    """'imagefolder', 'parquet' or 'cifar10'; a clear error for anything else."""
    if (src / CLASSES_FILE).is_file():
        return "parquet"
    if (src / "train").is_dir() and any(p.is_dir() for p in (src / "train").iterdir()):
        return "imagefolder"
    names = {"data_batch_1", "test_batch"}
    if src.name.endswith((".tar.gz", ".tgz", ".tar")) or any(
        (folder / n).is_file() for folder in (src, src / "cifar-10-batches-py") for n in names
    ):
        return "cifar10"
    raise DataError(
        f"SRC: {src} is neither an ImageFolder tree (train/<class>/...), a parquet dataset "
        f"({CLASSES_FILE} + train/*.parquet), nor CIFAR-10 python batches"
    )


def _png(chw: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0))).save(buffer, format="PNG")
    return buffer.getvalue()


def source_records(src: Path) -> tuple[list[str], dict[str, list[ImageRecord]]]:
    """Class names and the records of each split present in ``src``."""
    layout = detect_layout(src)
    if layout == "imagefolder":
        classes = list_classes(src / "train")
        splits = {s: list_files(src / s, classes) for s in SPLITS if (src / s).is_dir()}
        return classes, splits
    if layout == "parquet":
        splits = {s: read_records(src / s) for s in SPLITS if shard_files(src / s)}
        return read_classes(src), splits
    arrays = read_cifar10(src)
    splits = {
        split: [
            ImageRecord(f"{split}#{i}", int(label), data=_png(image))
            for i, (image, label) in enumerate(zip(*arrays[split], strict=True))
        ]
        for split in ("train", "test")
    }
    return list(CIFAR10_CLASSES), splits


def image_size(record: ImageRecord) -> tuple[str | None, str | None]:
    """("WxH", None) for a readable record, (None, reason) otherwise."""
    try:
        with Image.open(io.BytesIO(record.read_bytes())) as img:
            img.load()
            return f"{img.width}x{img.height}", None
    except UNREADABLE as exc:
        return None, unreadable_reason(exc)


def scan(records: list[ImageRecord], classes: list[str]) -> tuple[SplitReport, list[ImageRecord]]:
    """A split's report and its readable records."""
    report, good = SplitReport(), []
    sizes: Counter[str] = Counter()
    balance: Counter[str] = Counter()
    for record in records:
        size, problem = image_size(record)
        if problem is not None:
            report.unreadable.append(f"{record.name} ({problem})")
            continue
        sizes[str(size)] += 1
        balance[classes[record.label] if 0 <= record.label < len(classes) else "?"] += 1
        good.append(record)
    report.count = len(good)
    report.sizes = dict(sizes.most_common())
    report.classes = {name: balance[name] for name in classes}
    return report, good


def inspect_dataset(path: Path) -> dict[str, Any]:
    """Counts, class balance, image sizes and unreadable records of every split."""
    classes, splits = source_records(path)
    report: dict[str, Any] = {"path": str(path), "layout": detect_layout(path)}
    report["classes"] = len(classes)
    report["splits"] = {name: asdict(scan(records, classes)[0]) for name, records in splits.items()}
    return report


def _shards(records: list[ImageRecord], shard_bytes: int) -> Iterator[list[ImageRecord]]:
    shard: list[ImageRecord] = []
    size = 0
    for record in records:
        shard.append(record)
        size += len(record.read_bytes())
        if size >= shard_bytes:
            yield shard
            shard, size = [], 0
    if shard:
        yield shard


def write_shards(records: list[ImageRecord], out: Path, shard_bytes: int) -> int:
    """Write ``records`` as parquet shards in ``out`` (replacing old ones); returns the count."""
    import pyarrow as pa  # 0.3 s to import: only where parquet is read
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for old in shard_files(out):
        old.unlink()
    start = 0
    count = 0
    for count, shard in enumerate(_shards(records, shard_bytes), start=1):
        table = pa.table(
            {
                "index": pa.array(range(start, start + len(shard)), pa.int64()),
                "image": pa.array([r.read_bytes() for r in shard], pa.binary()),
                "label": pa.array([r.label for r in shard], pa.int64()),
                "name": pa.array([r.name for r in shard], pa.string()),
            }
        )
        pq.write_table(table, out / f"part-{count - 1:05d}.parquet")
        start += len(shard)
    return count


def convert_dataset(src: Path, dst: Path, shard_mb: float = 256.0) -> dict[str, Any]:
    """Convert ``src`` to parquet shards in ``dst``; returns (and writes) the report."""
    classes, splits = source_records(src)
    report: dict[str, Any] = {"source": str(src), "layout": detect_layout(src), "splits": {}}
    for name, records in splits.items():
        split_report, good = scan(records, classes)
        bad_labels = [r.name for r in good if not 0 <= r.label < len(classes)]
        if bad_labels:
            raise DataError(f"SRC: record {bad_labels[0]} has a label outside the class map")
        split_report.shards = write_shards(good, dst / name, int(shard_mb * 2**20))
        report["splits"][name] = asdict(split_report)
    meta = {"format": FORMAT, "classes": classes, "source": str(src)}
    (dst / CLASSES_FILE).write_text(json.dumps(meta, indent=2))
    (dst / "convert_report.json").write_text(json.dumps(report, indent=2))
    return report


def report_lines(report: dict[str, Any]) -> list[str]:
    """A short human summary of an inspect or convert report."""
    lines = [f"{report.get('path') or report.get('source')} ({report['layout']})"]
    for name, split in report["splits"].items():
        shards = f", {split['shards']} shard(s)" if split.get("shards") else ""
        sizes = ", ".join(f"{size} x{n}" for size, n in list(split["sizes"].items())[:3])
        lines.append(f"{name}: {split['count']} images{shards}; sizes {sizes or '-'}")
        balance = ", ".join(f"{c} {n}" for c, n in split["classes"].items())
        lines.append(f"  classes: {balance}")
        lines.append(f"  unreadable: {len(split['unreadable'])}")
        lines += [f"    {item}" for item in split["unreadable"][:20]]
    return lines
