"""Set-up memory of a sharded model: each rank's peak RSS while it is built, laid out and filled.

Question: does a rank of ``fsdp2`` x 4 hold only its share of a model while setting it up?
Each tree measured (``--tree``: a checkout's root, e.g. a ``git worktree`` of an older commit;
default this one) starts 4 gloo ranks on this machine that build the model as the engine
does, shard it with ``fsdp2`` and fill it; each reports its peak resident set (``VmHWM``)
before and after. ``gpt_tiny`` in the same processes is the baseline (Python, torch, the
process group). The bound the issue sets: a quarter of the fp32 model x 1.2 above the
baseline. With ``--train``, ``convoy train`` then runs the model for 3 steps on torchrun x 4
in this tree and its summary's set-up and run peaks per rank are reported too.

    python benchmarks/setup_memory.py [--tree OLD_CHECKOUT] [--train] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
MODELS = ("gpt_tiny", "gpt_1b")
WORKERS = 4
JOB = [
    "model.kwargs={dropout: 0.0}",
    "task.name=language_modeling",
    "data.name=text",
    "data.tokenizer=bpe",
    "data.vocab_size=2048",
    "data.seq_len=16",
    "data.batch_size=4",
    "strategy.name=fsdp2",
    f"scaling.num_workers={WORKERS}",
]


def rank_setup(ctx: Any, model_name: str) -> dict[str, Any]:
    """On one rank: build, shard and fill ``model_name`` as this tree's engine does."""
    import torch

    from convoy.config import load_job
    from convoy.distributed import peak_rss_bytes, process_group
    from convoy.models import registry
    from convoy.strategies import build_strategy
    from convoy.strategies.blocks import prepare_blocks

    job = load_job(None, [f"model.name={model_name}", *JOB])
    shape = {"vocab_size": 2048}
    strategy = build_strategy(job.strategy, ctx.device, torch.float32, ctx.local_world_size)
    with process_group(ctx, 1800.0):
        before = peak_rss_bytes()
        start = time.perf_counter()
        if hasattr(registry, "build_skeleton"):  # built on meta, filled after sharding
            model, weights = registry.build_skeleton(
                job.model.name, job.model.kwargs, shape, job.run.seed
            )
            model = strategy.wrap(prepare_blocks(model, job.strategy, False), weights)
        else:  # every rank builds it whole, then shards it
            model = registry.build_model(job.model.name, job.model.kwargs, shape)
            model = strategy.wrap(prepare_blocks(model, job.strategy, False))
        seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())  # global shapes (DTensor)
        return {"before": before, "after": peak_rss_bytes(), "seconds": seconds, "params": params}


def measure(tree: Path) -> dict[str, list[dict[str, Any]]]:
    """Each model's per-rank figures, in processes that import ``tree``'s Convoy."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run(
        [sys.executable, __file__, "--measure"],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    results: dict[str, list[dict[str, Any]]] = json.loads(out.strip().splitlines()[-1])
    print(f"{tree}: {json.dumps(results)}", flush=True)  # kept if what follows fails
    return results


def measure_here() -> None:
    from convoy.testing import run_on_gloo

    results = {name: run_on_gloo(rank_setup, WORKERS, name) for name in MODELS}
    print(json.dumps(results))


def train_run(tmp: Path) -> dict[str, Any]:
    """``convoy train`` of gpt_1b, 3 steps on torchrun x 4, in this tree: its summary."""
    cmd = [
        sys.executable,
        "-m",
        "convoy",
        "train",
        "-o",
        "model.name=gpt_1b",
        *(x for o in JOB for x in ("-o", o)),
        "-o",
        "scaling.launcher=torchrun",
        "-o",
        "run.max_steps=3",
        "-o",
        "run.log_every_steps=1",
        "-o",
        "optim.name=sgd",  # no optimizer state: the set-up is what is measured here
        "-o",
        "checkpoint.every_epochs=null",
        "-o",
        "checkpoint.every_steps=null",
        "-o",
        f"run.storage_dir={tmp}",
        "-o",
        "run.name=gpt_1b",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=REPO, check=True)
    summary = json.loads((tmp / "gpt_1b" / "summary.json").read_text())
    summary["command_seconds"] = time.perf_counter() - start
    return summary


def rows(label: str, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    tiny = max(r["after"] for r in results["gpt_tiny"])
    big = results["gpt_1b"]
    model_bytes = big[0]["params"] * 4
    bound = tiny + model_bytes / WORKERS * 1.2
    peaks = [r["after"] for r in big]
    return [
        f"| {label} | {big[0]['params'] / 1e9:.3f} B ({model_bytes / GIB:.2f} GiB fp32) | "
        f"{tiny / GIB:.2f} | {', '.join(f'{p / GIB:.2f}' for p in peaks)} | "
        f"{(max(peaks) - tiny) / GIB:.2f} | {bound / GIB:.2f} | "
        f"{'yes' if max(peaks) <= bound else 'no'} | {max(r['seconds'] for r in big):.1f} |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", type=Path, help="an older checkout to measure beside this one")
    parser.add_argument("--train", action="store_true", help="also train gpt_1b for 3 steps")
    parser.add_argument("--out", type=Path, help="folder for the dated markdown file")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure_here()
        return
    table = [
        "| tree | gpt_1b | baseline peak GiB (gpt_tiny) | set-up peak per rank GiB | "
        "above baseline GiB | bound GiB | within | set-up s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if args.tree:
        table += rows(f"before ({args.tree.name})", measure(args.tree))
    table += rows("after (this tree)", measure(REPO))
    header = (
        f"{platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}; fsdp2 x "
        f"{WORKERS} gloo ranks on this machine; VmHWM per rank after build + fully_shard + "
        "fill (RSS: pages touched). Bound: baseline + fp32 model / 4 x 1.2."
    )
    if args.train:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="convoy-setup-") as tmp:
            summary = train_run(Path(tmp))
        setup = summary["setup_peak_memory_bytes_per_rank"]
        peak = summary["peak_memory_bytes_per_rank"]
        losses = summary["metrics"]
        table += [
            "",
            "`convoy train` gpt_1b, fsdp2 x 4 on torchrun, 3 steps (seq 16, global batch 4):",
            "",
            "| set-up peak per rank GiB | run peak per rank GiB | command s | final metrics |",
            "|---|---|---|---|",
            f"| {', '.join(f'{b / GIB:.2f}' for b in setup)} | "
            f"{', '.join(f'{b / GIB:.2f}' for b in peak)} | {summary['command_seconds']:.0f} | "
            f"{json.dumps({k: round(v, 4) for k, v in losses.items()})} |",
        ]
    from dated import publish

    publish(args.out, "setup_memory", "Set-up memory of fsdp2 x 4", header, "\n".join(table))


if __name__ == "__main__":
    main()
