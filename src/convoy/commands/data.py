"""``convoy data prepare-imagenet | convert | synth-telematics | inspect``: dataset tools."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Each action imports its data module when it runs: they import torch, numpy or Pillow, and
# building the CLI (every `convoy` command) should import none of them.


def add_parser(commands: Any) -> None:
    """Add ``data`` and its actions to ``convoy``'s sub-parsers."""
    data = commands.add_parser(
        "data", help="prepare, convert and inspect datasets", description="Dataset tools."
    )
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    _add_prepare_imagenet_parser(actions)
    _add_convert_parser(actions)
    _add_synth_telematics_parser(actions)
    _add_inspect_parser(actions)


def _add_prepare_imagenet_parser(actions: Any) -> None:
    parser = actions.add_parser(
        "prepare-imagenet",
        help="ILSVRC train/ + flat val/ + LOC_val_solution.csv -> an ImageFolder tree",
        description="Hard-link (or copy) ILSVRC images into DST/train/<wnid>/ and "
        "DST/val/<wnid>/. Idempotent; reports missing, unlabeled and unreadable files.",
    )
    parser.add_argument("src", help="folder with train/, val/ and LOC_val_solution.csv")
    parser.add_argument("dst", help="the ImageFolder tree to create or complete")
    parser.set_defaults(handler=prepare_imagenet)


def _add_convert_parser(actions: Any) -> None:
    parser = actions.add_parser(
        "convert",
        help="an ImageFolder tree or CIFAR-10 batches -> parquet shards",
        description="Write parquet shards (index, image bytes, label, name) and classes.json; "
        "unreadable or missing files are left out and reported.",
    )
    parser.add_argument("src", help="ImageFolder tree, or CIFAR-10 batches (folder or .tar.gz)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--format", choices=["parquet"], default="parquet")
    parser.add_argument(
        "--shard-mb", type=float, default=256.0, help="target shard size in MiB (default 256)"
    )
    parser.set_defaults(handler=convert)


def _add_synth_telematics_parser(actions: Any) -> None:
    parser = actions.add_parser(
        "synth-telematics",
        help="write a fleet's accelerometer/gyroscope windows with driving events (parquet)",
        description="Seeded synthetic telematics: DEVICES vehicles x HOURS of 6-channel "
        "series cut into labelled windows (normal, harsh_brake, harsh_accel, sharp_turn, "
        "pothole), split by device into train/val/test parquet shards that data.name: series "
        "streams. OUT is a folder or s3://bucket/prefix.",
    )
    parser.add_argument("out", help="output folder or s3://bucket/prefix")
    parser.add_argument("--devices", type=int, required=True, help="vehicles (at least 3)")
    parser.add_argument("--hours", type=float, required=True, help="hours recorded per vehicle")
    parser.add_argument("--rate-hz", type=int, default=20, help="samples per second (default 20)")
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds per window (10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=float, default=64.0, help="MiB per shard (64)")
    parser.add_argument("--rows-per-group", type=int, default=512, help="rows per row group (512)")
    parser.add_argument(
        "--layout",
        choices=["lists", "packed"],
        default="lists",
        help="channels as list<float32> (default) or packed float32 bytes, read faster",
    )
    parser.set_defaults(handler=synth_telematics)


def _add_inspect_parser(actions: Any) -> None:
    parser = actions.add_parser(
        "inspect",
        help="counts, class balance, image sizes and unreadable files of a dataset",
        description="Read an ImageFolder tree, a parquet dataset or CIFAR-10 batches and report.",
    )
    parser.add_argument("path")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=inspect)


def prepare_imagenet(args: argparse.Namespace) -> int:
    """Link ILSVRC's images into an ImageFolder tree and print the report."""
    from convoy.data.imagenet import prepare_imagenet as prepare

    print("\n".join(prepare(Path(args.src), Path(args.dst)).lines()))
    return 0


def convert(args: argparse.Namespace) -> int:
    """Write the dataset as parquet shards and print the report."""
    from convoy.data.convert import convert_dataset, report_lines

    report = convert_dataset(Path(args.src), Path(args.dst), args.shard_mb)
    print("\n".join(report_lines(report)))
    print(f"wrote {args.dst}")
    return 0


def synth_telematics(args: argparse.Namespace) -> int:
    """Write a synthetic fleet and say how many rows each split got."""
    from convoy.data.telematics import FleetSpec, write_fleet

    spec = FleetSpec(
        args.devices,
        args.hours,
        args.rate_hz,
        args.window_s,
        args.seed,
        args.shard_mb,
        args.rows_per_group,
        args.layout,
    )
    summary = write_fleet(spec, args.out)
    rows = ", ".join(f"{split} {count:,}" for split, count in summary["rows"].items())
    mib = sum(summary["rows"].values()) * summary["bytes_per_row"] / 2**20
    print(
        f"wrote {args.out}: {spec.devices} devices, windows of {spec.steps} steps x "
        f"{len(summary['channels'])} channels; rows {rows} ({mib:,.1f} MiB of float32 series)"
    )
    return 0


def inspect(args: argparse.Namespace) -> int:
    """Print a dataset's report, as text or JSON."""
    from convoy.data.convert import inspect_dataset, report_lines

    report = inspect_dataset(Path(args.path))
    print(json.dumps(report, indent=2) if args.json else "\n".join(report_lines(report)))
    return 0
