"""``convoy data prepare-imagenet SRC DST``: the ILSVRC layout -> an ImageFolder tree.

SRC holds ``train/<wnid>/*.JPEG`` (already one folder per class), a flat ``val/`` and
``LOC_val_solution.csv`` (``ImageId,PredictionString`` where the string starts with the wnid),
as the ILSVRC / Kaggle download ships them. DST gets ``train/<wnid>/`` and ``val/<wnid>/``.
Files are hard-linked when SRC and DST share a file system (no extra space) and copied
otherwise. Running it again only adds what is missing. It reports what it could not place:
val images the CSV names but that are not there, val images the CSV does not name, and files
Pillow cannot read (those are left out of DST, so training never meets them).
"""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image

from convoy.data.imagefolder import IMAGE_SUFFIXES
from convoy.errors import DataError

SOLUTION_FILE = "LOC_val_solution.csv"
REPORT_FILE = "prepare_report.json"


@dataclass
class PrepareReport:
    placed: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    already_there: int = 0
    classes: int = 0
    missing: list[str] = field(default_factory=list)
    """Val images named by the CSV that SRC does not have."""
    unlabeled: list[str] = field(default_factory=list)
    """Val images the CSV does not name."""
    unreadable: list[str] = field(default_factory=list)
    """Files Pillow cannot open (left out of DST), with the reason."""

    def lines(self) -> list[str]:
        out = [
            f"classes: {self.classes}",
            f"placed: {self.placed['train']} train, {self.placed['val']} val "
            f"({self.already_there} already in place)",
        ]
        for label, items in (
            ("missing (named in the CSV, not in val/)", self.missing),
            ("unlabeled (in val/, not in the CSV)", self.unlabeled),
            ("unreadable (left out)", self.unreadable),
        ):
            out.append(f"{label}: {len(items)}")
            out += [f"  {item}" for item in items[:20]]
            if len(items) > 20:
                out.append(f"  ... and {len(items) - 20} more (see {REPORT_FILE})")
        return out


def read_val_labels(csv_path: Path) -> dict[str, str]:
    """ImageId -> wnid, from ``LOC_val_solution.csv``."""
    labels = {}
    with csv_path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                labels[row["ImageId"]] = row["PredictionString"].split()[0]
            except (KeyError, IndexError):
                raise DataError(
                    f"{csv_path}: expected columns ImageId,PredictionString with a wnid first; "
                    f"got {row}"
                ) from None
    return labels


def readable(path: Path) -> str | None:
    """None if Pillow can open and verify the file, else the reason."""
    try:
        with Image.open(path) as img:
            img.verify()
    except (OSError, ValueError, SyntaxError) as exc:
        return str(exc) or type(exc).__name__
    return None


def place(source: Path, target: Path) -> bool:
    """Hard-link (or copy across file systems) ``source`` to ``target``; False if present."""
    if target.exists() and target.stat().st_size == source.stat().st_size:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(source, target)
    return True


def _place_checked(source: Path, target: Path, split: str, report: PrepareReport) -> None:
    reason = readable(source)
    if reason is not None:
        report.unreadable.append(f"{source} ({reason})")
    elif place(source, target):
        report.placed[split] += 1
    else:
        report.already_there += 1


def prepare_imagenet(src: Path, dst: Path) -> PrepareReport:
    """Build (or complete) the ImageFolder tree in ``dst``; writes and returns the report."""
    train, val, solution = src / "train", src / "val", src / SOLUTION_FILE
    for needed in (train, val, solution):
        if not needed.exists():
            raise DataError(
                f"SRC: {src} has no {needed.name}; expected train/<wnid>/*.JPEG, a flat val/ "
                f"and {SOLUTION_FILE}"
            )
    report = PrepareReport()
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    report.classes = len(classes)
    for wnid in classes:
        for image in sorted((train / wnid).iterdir()):
            if image.suffix.lower() in IMAGE_SUFFIXES:
                _place_checked(image, dst / "train" / wnid / image.name, "train", report)
    labels = read_val_labels(solution)
    present = {p.stem: p for p in val.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES}
    for image_id, wnid in sorted(labels.items()):
        found = present.get(image_id)
        if found is None:
            report.missing.append(f"{val / image_id}.JPEG")
        elif wnid not in classes:
            report.unreadable.append(f"{found} (wnid {wnid} is not a train/ class)")
        else:
            _place_checked(found, dst / "val" / wnid / found.name, "val", report)
    report.unlabeled = sorted(str(p) for stem, p in present.items() if stem not in labels)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2))
    return report
