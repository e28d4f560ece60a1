"""fsdp2 vs hsdp on two test hosts: the bytes each step sends over the inter-node link.

Question: HSDP keeps all-gathers and reduce-scatters inside a node and sends only an
all-reduce of gradient shards between nodes; how many bytes per step cross the link, against
fsdp2 sharding over every rank? Two test hosts (network namespaces on a bridge,
``tests/cluster/netns.py``; each pinned to a core of its own), 2 torchrun workers on each
(4 ranks, gloo), ``recipes/lm_tiny.yaml`` (gpt_tiny, global batch 32), fp32. Bytes are
``tx_bytes`` + ``rx_bytes`` of host h0's ``eth0`` (its only link, to h1 through the bridge),
read before and after each run; to leave out start-up, rendezvous and evaluation, each
strategy runs ``--steps`` and 2 x ``--steps`` steps, and the per-step figure is the
difference over ``--steps``. hsdp's shard group is the default, the 2 workers of a node.

Formula beside it (psi = parameter bytes, each direction, per step): fsdp2 must carry at least
h0's half of every all-gather (two, forward and backward) and of the reduce-scatter to the
other host, 3 x psi / 2; hsdp's replicas all-reduce each rank's psi / 2 shard in pairs across
the link, psi / 2 per pair, 2 pairs: psi.

    python benchmarks/hsdp_two_hosts.py [--steps 10] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from netns import Host, TestHosts, cannot_make_hosts  # noqa: E402

from dated import publish  # noqa: E402  (this folder)

CONVOY = [sys.executable, "-m", "convoy", "train", str(REPO / "recipes" / "lm_tiny.yaml")]
STRATEGIES = ("fsdp2", "hsdp")


def link_bytes(host: Host) -> int:
    """tx + rx bytes of the host's eth0 so far."""
    stats = "/sys/class/net/eth0/statistics"
    out = host.run(["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"], check=True).stdout
    return sum(int(line) for line in out.split())


def run_on_two_hosts(hosts: TestHosts, storage: Path, strategy: str, steps: int) -> int:
    """One 2 x 2 torchrun run; the bytes h0's link carried during it."""
    head, worker = hosts
    overrides = [
        f"strategy.name={strategy}",
        "model.kwargs.dropout=0.0",
        "scaling.launcher=torchrun",
        "scaling.num_workers=4",
        "scaling.torchrun.nnodes=2",
        "scaling.torchrun.nproc_per_node=2",
        f"scaling.torchrun.rdzv_endpoint={head.ip}:29400",
        f"run.max_steps={steps}",
        "run.progress=off",
        f"run.storage_dir={storage}",
        "run.shared_storage=true",
        f"run.name={strategy}-{steps}",
    ]
    command = [*CONVOY, *(f"-o{o}" for o in overrides)]
    before = link_bytes(head)
    drivers = [
        host.popen(
            ["taskset", "-c", str(i % len(os.sched_getaffinity(0))), *command],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, host in enumerate((head, worker))
    ]
    if any(driver.wait(timeout=900) for driver in drivers):
        raise RuntimeError(f"the two-host {strategy} run of {steps} steps failed")
    return link_bytes(head) - before


def parameter_bytes() -> int:
    from convoy.bench.compare import parameter_bytes as psi
    from convoy.config import load_job

    size = psi(load_job(REPO / "recipes" / "lm_tiny.yaml", ["model.kwargs.dropout=0.0"]))
    assert size is not None
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reason = cannot_make_hosts()
    if reason:
        raise SystemExit(f"hsdp benchmark: {reason}")
    psi = parameter_bytes()
    formula = {"fsdp2": 1.5 * psi * 2, "hsdp": 1.0 * psi * 2}  # both directions
    rows = []
    with tempfile.TemporaryDirectory(prefix="convoy-hsdp-") as tmp, TestHosts(2) as hosts:
        per_step = {}
        for strategy in STRATEGIES:
            short = run_on_two_hosts(hosts, Path(tmp), strategy, args.steps)
            long = run_on_two_hosts(hosts, Path(tmp), strategy, 2 * args.steps)
            per_step[strategy] = (long - short) / args.steps
        for strategy in STRATEGIES:
            rows.append(
                f"| {strategy} | {per_step[strategy] / 2**20:.2f} | "
                f"{per_step[strategy] / psi:.2f} | {formula[strategy] / psi:.2f} | "
                f"{per_step[strategy] / per_step['fsdp2']:.3f} |"
            )
    table = "\n".join(
        [
            "| strategy | link MiB / step (both directions) | in psi | formula (psi, at least) "
            "| / fsdp2 |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    header = (
        f"{date.today()}, {platform.machine()}, 2 test hosts x 2 gloo workers, gpt_tiny, "
        f"psi = {psi / 2**20:.2f} MiB, {args.steps} vs {2 * args.steps} steps"
    )
    publish(args.out, "hsdp_two_hosts", "fsdp2 vs hsdp across two test hosts (CPU)", header, table)


if __name__ == "__main__":
    main()
