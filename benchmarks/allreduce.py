"""All-reduce bandwidth on CPU (gloo): one node, and two test hosts.

Question: what bus bandwidth does gloo reach between Convoy's workers, by message size, on one
node and across two hosts? Runs ``convoy bench allreduce`` (in-place sum, float32, 8 B to
32 MiB, x2, 20 timed iterations after 5 warm-up at each size) twice, in one go:

- ``one node``: ``scaling.launcher=torchrun``, 2 workers on this machine;
- ``two hosts``: the same command on two test hosts (network namespaces joined by veth pairs
  and a bridge, ``tests/cluster/netns.py``), one worker each, c10d rendezvous on the first,
  each host pinned to a core of its own. Needs root and ``ip``; skipped with the reason
  otherwise.

    python benchmarks/allreduce.py [--max-bytes 32M] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from netns import TestHosts, cannot_make_hosts  # noqa: E402

from convoy.bench.allreduce import format_table, plot  # noqa: E402

RECIPE = str(REPO / "recipes" / "default.yaml")


def command(storage: Path, name: str, max_bytes: str, *overrides: str) -> list[str]:
    args = [f"run.storage_dir={storage}", f"run.name={name}", "scaling.launcher=torchrun"]
    return [
        sys.executable, "-m", "convoy", "bench", "allreduce", RECIPE,
        *(f"-o{o}" for o in [*args, *overrides]),
        "--max-bytes", max_bytes, "--out", str(storage),
    ]  # fmt: skip


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core % len(os.sched_getaffinity(0))), *cmd]


def one_node(storage: Path, max_bytes: str) -> dict:  # type: ignore[type-arg]
    subprocess.run(command(storage, "one-node", max_bytes), check=True, capture_output=True)
    return json.loads((storage / "one-node" / "summary.json").read_text())  # type: ignore[no-any-return]


def two_hosts(storage: Path, max_bytes: str) -> dict | str:  # type: ignore[type-arg]
    """The two-host result, or why it could not run."""
    reason = cannot_make_hosts()
    if reason:
        return reason
    with TestHosts(2) as hosts:
        head = hosts[0]
        cmd = command(
            storage,
            "two-hosts",
            max_bytes,
            "run.shared_storage=true",
            "scaling.torchrun.nnodes=2",
            f"scaling.torchrun.rdzv_endpoint={head.ip}:29400",
        )
        drivers = [
            host.popen(pinned(i, cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i, host in enumerate(hosts)
        ]
        if any(driver.wait(timeout=600) for driver in drivers):
            return "the two-host torchrun run failed"
    return json.loads((storage / "two-hosts" / "summary.json").read_text())  # type: ignore[no-any-return]


def side_by_side(one: dict, two: dict | None) -> str:  # type: ignore[type-arg]
    """size | one-node time, busbw | two-host time, busbw."""
    rows = ["| size (B) | one node: time (us) | one node: busbw (GB/s) | two hosts: time (us) "
            "| two hosts: busbw (GB/s) |", "|---|---|---|---|---|"]  # fmt: skip
    others = {r["size_bytes"]: r for r in (two or {}).get("rows", [])}
    for r in one["rows"]:
        o = others.get(r["size_bytes"])
        far = f"{o['time_us']:.1f} | {o['busbw_gbps']:.4f}" if o else "- | -"
        rows.append(f"| {r['size_bytes']} | {r['time_us']:.1f} | {r['busbw_gbps']:.4f} | {far} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-bytes", default="32M")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    import torch

    stem = f"allreduce_cpu_{date.today().isoformat()}"
    with tempfile.TemporaryDirectory(prefix="convoy-allreduce-") as tmp:
        one = one_node(Path(tmp), args.max_bytes)
        two = two_hosts(Path(tmp), args.max_bytes)
    plot(one, str(args.out / f"{stem}.png"))
    two_result = two if isinstance(two, dict) else None
    if two_result:
        plot(two_result, str(args.out / f"{stem}_two_hosts.png"))
        two_text = f"```\n{format_table(two_result)}\n```\n\n![two hosts]({stem}_two_hosts.png)"
    else:
        two_text = f"Not run: {two}."
    table = side_by_side(one, two_result)
    largest = one["rows"][-1]
    far = two_result["rows"][-1] if two_result else None
    text = f"""# All-reduce bandwidth, gloo on CPU: one node and two test hosts, {date.today().isoformat()}

Produced by `python benchmarks/allreduce.py --max-bytes {args.max_bytes}` (root for the
two-host part), which runs `convoy bench allreduce` through the torchrun launcher.

- Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU;
  Python {platform.python_version()}, torch {torch.__version__}. **The machine was shared**
  with other work while this ran: absolute figures are noisy; the two layouts ran back to back
  in one go.
- In-place `all_reduce` (sum, float32), {one["iters"]} timed iterations after {one["warmup"]}
  warm-up at each size; time = mean per op, averaged over ranks; busbw = algbw x 2(n-1)/n
  (= algbw for n = 2); GB/s = 1e9 B/s.
- Two hosts: network namespaces on this machine, one worker each, each pinned to its own
  core, talking over veth pairs and a bridge: the software path of a two-node run (gloo over
  TCP between hosts), not a real network.

At the largest size ({largest["size_bytes"]} B): one node {largest["busbw_gbps"]:.3f} GB/s
busbw{f", two hosts {far['busbw_gbps']:.3f} GB/s" if far else ""}.

{table}

## One node (2 workers, torchrun)

```
{format_table(one)}
```

![one node]({stem}.png)

## Two test hosts (1 worker each, torchrun c10d rendezvous)

{two_text}
"""
    out = args.out / f"{stem}.md"
    out.write_text(text)
    print(table)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
