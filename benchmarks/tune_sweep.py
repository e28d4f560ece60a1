"""The evidence sweep of benchmarks/tune_cpu_2026-11-23.md: 8 trials of recipes/default.yaml
over lr x strategy x batch with ASHA, then a sweep interrupted after its first trial and
resumed. Run from the repository root: .venv/bin/python benchmarks/tune_sweep.py OUT_DIR
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

COMMON = [
    "recipes/default.yaml",
    "--space",
    "recipes/sweeps/default_space.yaml",
    "-o",
    "run.epochs=4",
    "-o",
    "scaling.cpus_per_worker=0.5",
    "-o",
    "run.progress=off",
]


def tune(out: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "convoy", "tune", *COMMON, "-o", f"run.storage_dir={out}"]
    return subprocess.Popen([*command, *args], text=True)


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    start = time.perf_counter()
    tune(out, "--name", "asha8", "--samples", "4").wait()
    print(f"asha8 wall {time.perf_counter() - start:.0f} s")
    # Interrupted after its first finished trial, then resumed.
    sweep = out / "resume4"
    first = tune(out, "--name", "resume4", "--samples", "2", "--max-concurrent", "1")
    while not list(sweep.glob("*/summary.json")):
        time.sleep(1)
    first.send_signal(signal.SIGINT)
    first.wait()
    done = {
        p.parent.name: p.parent.joinpath("metrics.jsonl").read_text()
        for p in sweep.glob("*/summary.json")
    }
    tune(out, "--name", "resume4", "--samples", "2", "--max-concurrent", "1", "--resume").wait()
    same = all(sweep.joinpath(t, "metrics.jsonl").read_text() == text for t, text in done.items())
    results = json.loads((sweep / "results.json").read_text())
    print(
        f"resume4: finished before the interrupt {sorted(done)}, untouched after resume: {same}, "
        f"trials {len(results['trials'])}"
    )


if __name__ == "__main__":
    main()
