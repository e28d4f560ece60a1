"""``convoy export RUN_DIR [--checkpoint step_N] --format safetensors``: one checkpoint as a
single-device model.safetensors plus model.json."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from convoy.storage import is_remote


def add_parser(commands: Any) -> None:
    """Add the ``export`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "export",
        help="export a checkpoint to one safetensors file",
        description="Consolidate a run's checkpoint (sharded by any strategy and world size) "
        "into one single-device model.safetensors plus model.json, loadable with plain PyTorch.",
    )
    parser.add_argument(
        "run", help="the run directory, <run.storage_dir>/<run.name> (a path or s3:// URI)"
    )
    parser.add_argument(
        "--checkpoint", help="a checkpoint name like step_00000312 (default: latest)"
    )
    parser.add_argument("--format", choices=["safetensors"], default="safetensors")
    parser.add_argument(
        "--out",
        help="output directory (default: <run>/export/<checkpoint>; for an s3:// run, "
        "./export/<run name>/<checkpoint>)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Export the chosen (default: latest) checkpoint and say where it went."""
    # Heavy (the exporter loads torch.distributed's checkpoint stack): imported only here.
    from convoy.export import export_checkpoint, find_checkpoint

    checkpoint = find_checkpoint(args.run, args.checkpoint)
    if args.out:
        out = Path(args.out)
    elif is_remote(args.run):  # next to where the command runs: exports are local files
        out = Path("export") / args.run.rstrip("/").rsplit("/", 1)[-1] / checkpoint
    else:
        out = Path(args.run) / "export" / checkpoint
    print(f"exported {checkpoint} to {export_checkpoint(args.run, out, checkpoint)}")
    return 0
