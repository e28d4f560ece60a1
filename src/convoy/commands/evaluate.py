"""``convoy evaluate EXPORT_DIR``: an export's test metrics, beside those recorded when it
was trained."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from convoy.commands.common import add_override_arg
from convoy.commands.summary_lines import COUNT_COLUMNS


def add_parser(commands: Any) -> None:
    """Add the ``evaluate`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "evaluate",
        help="evaluate an exported model on its test split",
        description="Load an export (no process group, no pickle) and compute its test metrics "
        "on the job's dataset; prints them beside the metrics recorded at training time.",
    )
    parser.add_argument("export", help="a directory written by convoy export")
    add_override_arg(parser, "data.path=/new/place")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print measured and recorded metrics side by side."""
    # Heavy (the exporter loads torch.distributed's checkpoint stack): imported only here.
    from convoy.export import MODEL_FILE, evaluate_exported

    export_dir = Path(args.export)
    recorded = json.loads((export_dir / MODEL_FILE).read_text()).get("metrics", {})
    measured = evaluate_exported(export_dir, args.override)
    print(f"{'metric':<16}{'measured':>14}{'recorded':>14}")
    for key, value in measured.items():
        before = recorded.get(key)
        shown = (value, before) if before is not None else (value,)
        print(f"{key:<16}" + "".join(_evaluated(key, v) for v in shown))
    return 0


def _evaluated(key: str, value: float) -> str:
    """A count as an integer, any other metric to six decimals."""
    if key.rpartition("/")[2] in COUNT_COLUMNS:
        return f"{int(value):>14}"
    return f"{value:>14.6f}"
