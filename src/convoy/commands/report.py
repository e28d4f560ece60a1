"""``convoy report RUN [RUN...]``: plots of one run, or several overlaid, as HTML and PNGs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from convoy.report import make_report

DESCRIPTION = """\
Plot one run, or several overlaid for comparison: loss and metric curves, learning rate,
throughput, step time, data-wait fraction and memory per rank, and a table comparing the
runs' summaries. Writes one self-contained HTML file (figures embedded, nothing fetched
from the network) and the PNGs. A resumed run's repeated steps are shown once, with the
last attempt's values; figures no run has data for are left out and listed.
"""
EXAMPLES = """\
examples:
  convoy report runs/exp1                       # writes runs/exp1/report/report.html
  convoy report runs/ddp runs/fsdp2 --out cmp   # two runs overlaid, in ./cmp/
  convoy report s3://my-bucket/runs/exp2        # writes ./report-exp2/
"""


def add_parser(commands: Any) -> None:
    """Add the ``report`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "report",
        help="plot runs (loss, metrics, LR, step time, data wait, memory) as HTML + PNGs",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a run directory, <run.storage_dir>/<run.name> (a path or s3:// URI)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="output directory (default: <first run>/report/; for an s3:// run, "
        "./report-<run name>/)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Write the report and print what was left out and the paths written."""
    report, paths = make_report(args.runs, Path(args.out) if args.out else None)
    for note in report.notes:
        print(f"note: {note}")
    for path in paths:
        print(path)
    return 0
