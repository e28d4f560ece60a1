"""Multi-node: the default recipe on one node, on two Ray nodes and on two torchrun nodes.

Question: does spreading the same job over two machines change its results, and what does it
cost per step? The two "machines" are test hosts on this one (network namespaces, one veth
each on a bridge, ``tests/cluster/netns.py``), so the comparison measures the software path
(gloo over TCP between hosts, Ray's or torchrun's multi-node set-up), not a real network. Each
host is pinned to a core of its own (CPU affinity), as separate machines would be. Needs root
and ``ip``; runs, in one go:

- ``one node``: ``scaling.launcher=torchrun``, 2 workers on this machine (the reference);
- ``two Ray nodes``: ``ray start --head`` on h0 and ``ray start --address`` on h1 (token auth),
  one CPU each, the driver on h0 with ``RAY_ADDRESS``: one worker per node;
- ``two torchrun nodes``: the same ``convoy train -o scaling.launcher=torchrun`` on h0 and h1,
  c10d rendezvous on h0: one worker per node.

    python benchmarks/multinode.py [--epochs 5] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from netns import RayNodes, TestHosts, cannot_make_hosts  # noqa: E402

CONVOY = [sys.executable, "-m", "convoy", "train", str(REPO / "recipes" / "default.yaml")]


def args_for(storage: Path, name: str, epochs: int, *extra: str) -> list[str]:
    overrides = [
        f"run.storage_dir={storage}",
        "run.shared_storage=true",
        f"run.name={name}",
        f"run.epochs={epochs}",
        "run.progress=off",
        *extra,
    ]
    return [*CONVOY, *(f"-o{o}" for o in overrides)]


def pinned(core: int, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(core % len(os.sched_getaffinity(0))), *command]


def run_all(storage: Path, epochs: int) -> dict[str, float]:
    """Run the three layouts; return each one's wall time (launch to exit)."""
    walls: dict[str, float] = {}
    start = time.time()
    subprocess.run(
        args_for(storage, "one-node", epochs, "scaling.launcher=torchrun"),
        check=True,
        capture_output=True,
    )
    walls["one-node"] = time.time() - start
    with TestHosts(2) as hosts:
        head, worker = hosts
        nodes = RayNodes()
        try:
            nodes.start_head(head, num_cpus=1)
            nodes.start_worker(worker, nodes.head.address, num_cpus=1)
            start = time.time()
            head.run(
                pinned(0, args_for(storage, "ray-two-nodes", epochs)),
                env=nodes.driver_env(),
                timeout=900,
                check=True,
            )
            walls["ray-two-nodes"] = time.time() - start
        finally:
            nodes.stop()
        torchrun = args_for(
            storage,
            "torchrun-two-nodes",
            epochs,
            "scaling.launcher=torchrun",
            "scaling.torchrun.nnodes=2",
            f"scaling.torchrun.rdzv_endpoint={head.ip}:29400",
        )
        start = time.time()
        drivers = [
            host.popen(pinned(i, torchrun), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i, host in enumerate((head, worker))
        ]
        if any(driver.wait(timeout=900) for driver in drivers):
            raise RuntimeError("the two-node torchrun run failed")
        walls["torchrun-two-nodes"] = time.time() - start
    return walls


def render(storage: Path, walls: dict[str, float]) -> str:
    summaries = {name: json.loads((storage / name / "summary.json").read_text()) for name in walls}
    reference = summaries["one-node"]
    rows = []
    for name, summary in summaries.items():
        metrics = summary["metrics"]
        same = all(
            abs(metrics[key] - value) <= 1e-6 + 1e-5 * abs(value)
            for key, value in reference["metrics"].items()
        )
        step = summary["step_seconds_median"] * 1e3
        rows.append(
            f"| {name} | {summary['world_size']} | {step:.2f} | "
            f"{step / (reference['step_seconds_median'] * 1e3):.3f} | {walls[name]:.1f} | "
            f"{metrics['test/loss']:.6f} | {metrics['test/acc'] * 100:.2f}% | "
            f"{'yes' if same else 'NO'} |"
        )
    header = (
        "| layout | workers | step (ms, median) | step / one node | wall (s) | test loss "
        "| test acc | metrics equal to one node |\n|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    reason = cannot_make_hosts()
    if reason:
        raise SystemExit(f"multinode benchmark: {reason}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch

    with tempfile.TemporaryDirectory(prefix="convoy-multinode-") as tmp:
        storage = Path(tmp)
        walls = run_all(storage, args.epochs)
        table = render(storage, walls)
    cpu = platform.processor() or platform.machine()
    text = f"""# Multi-node: one node vs two Ray nodes vs two torchrun nodes (CPU), {date.today().isoformat()}

Produced by `python benchmarks/multinode.py --epochs {args.epochs}` (root; test hosts).

- Machine: {os.cpu_count()} CPU cores ({cpu}), no GPU; Python {platform.python_version()},
  torch {torch.__version__}, Ray {ray.__version__}.
- Job: `recipes/default.yaml` (ViT, hidden 96, 4 blocks, on digits), `ddp`, 2 gloo workers,
  global batch 32, {args.epochs} epochs; only where the workers run differs.
- The two nodes are network namespaces on this machine, each pinned to its own core, talking
  over veth pairs and a bridge: the software path of a multi-node run, not a real network.
  The host name resolves to loopback in every host, as on many real machines: gloo is put on
  each node's own interface by Convoy.

{table}

*step* is rank 0's median step time after warm-up; *wall* is from the launch to the last
process exiting (for Ray: the driver joining the running cluster, Ray Train's worker start-up
and training). *metrics equal* compares every final metric with the one-node run
(rel 1e-5, abs 1e-6).
"""
    out = args.out / f"multinode_cpu_{date.today().isoformat()}.md"
    out.write_text(text)
    print(table)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
