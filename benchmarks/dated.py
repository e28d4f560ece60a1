"""The end of a benchmark script: print its header and table, and write them to a dated
markdown file (``<stem>_cpu_<date>.md``) under ``--out`` when given."""

from __future__ import annotations

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
