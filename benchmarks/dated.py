"""The helpers of this folder's benchmark scripts: the end of one (print its header and table,
and write them to a dated markdown file ``<stem>_cpu_<date>.md`` under ``--out`` when given),
and the bytecode of a source tree to compare."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from pathlib import Path


def publish(out: Path | None, stem: str, title: str, header: str, table: str) -> None:
    print(header)
    print(table)
    if out:
        out.mkdir(parents=True, exist_ok=True)  # a run of minutes must not end in a traceback
        path = out / f"{stem}_cpu_{date.today()}.md"
        path.write_text(f"# {title}\n\n{header}\n\n{table}\n")
        print(f"wrote {path}")


def compile_sources(tree: Path) -> None:
    """Write the bytecode of ``tree``'s sources, as ``make`` does at install: a tree compared
    without it (a fresh worktree; PYTHONDONTWRITEBYTECODE set, as on CI) would compile every
    module it imports in every process, and look dearer than it is."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "src")], check=True)
