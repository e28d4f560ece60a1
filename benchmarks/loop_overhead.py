"""Loop overhead: a Convoy step against a plain PyTorch loop over the same model and batch.

Question: what does Convoy's loop (exact metrics over all ranks, events, monitoring, stop
polls, heartbeats, checkpoints' bookkeeping) cost per step beyond the math, on the model a user
trains? Each repetition runs every workload's two sides back to back, interleaved:

- ``convoy``: ``python -m convoy train RECIPE`` as a user starts it, with the workload's
  overrides; its step time is the summary's ``step_seconds_median``;
- ``plain``: a nanoGPT-style loop in this file over the *same* model class, built from the same
  recipe (same optimizer and parameter groups, LR schedule, clipping, precision, compile): the
  training split held as tensors (on the device), a random permutation per epoch, one
  ``loss.item()`` a step. Under ``torchrun`` it is the same loop under DDP, each rank its half
  of the global batch.

Both report the median step after 3 warm-up steps. The table gives ms per step, the speed
ratio (plain / Convoy: 1.00 = as fast as the plain loop) and Convoy's extra ms per step.
``--before PATH`` also runs another checkout's Convoy (``PYTHONPATH``), interleaved, so a
before/after pair is one run on one machine.

    python benchmarks/loop_overhead.py [--workloads mlp,mlp-torchrun,gpt_tiny] [--repeats 3]
        [--steps 300] [--before PATH] [--out DIR]
    python benchmarks/loop_overhead.py --workloads gpt_small-16,gpt_small-64 (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 3


@dataclass(frozen=True)
class Workload:
    """One model, batch and precision; the same recipe and overrides for both sides."""

    recipe: str
    overrides: tuple[str, ...]
    workers: int = 1
    note: str = ""
    steps: int | None = None
    """Steps per run where ``--steps`` would take too long (a model whose step is slow)."""


GPT_SMALL = (
    "model.name=gpt_small",
    "model.kwargs.vocab_size=50304",
    "model.kwargs.dropout=0.0",
    "data.tokenizer=bytes",
    "data.seq_len=1024",
    "precision=bf16",
    "scaling.use_gpu=true",
)


def _gpt_small(batch: int, compiled: bool) -> Workload:
    compile_ = ("run.compile=model",) if compiled else ()
    return Workload(
        "recipes/lm_tiny.yaml",
        (*GPT_SMALL, f"data.batch_size={batch}", *compile_),
        note=f"gpt_small, batch {batch} x 1,024 tokens, bf16{', compiled' if compiled else ''}",
    )


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(
        "recipes/digits_mlp.yaml", (), note="digits_mlp (MLP 64-128-128-10), batch 32, fp32"
    ),
    "mlp-torchrun": Workload(
        "recipes/digits_mlp.yaml",
        (),
        workers=2,
        note="digits_mlp, global batch 32, ddp x 2 gloo under torchrun",
    ),
    "gpt_tiny": Workload(
        "recipes/lm_tiny.yaml",
        ("model.kwargs.dropout=0.0",),
        note="gpt_tiny (0.8 M), bpe 2,048, batch 32 x 128 tokens, fp32",
        steps=60,
    ),
    "gpt_small-16": _gpt_small(16, True),
    "gpt_small-16-eager": _gpt_small(16, False),
    "gpt_small-32": _gpt_small(32, True),
    "gpt_small-64": _gpt_small(64, True),
}


# ---------------------------------------------------------------------------------------------
# The plain loop (runs in its own process; under torchrun, one per rank).


def plain_loop(recipe: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of the recipe's model the way a short PyTorch script does; returns
    the median step time (after warm-up) and the last loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from convoy.config import load_job
    from convoy.data.registry import load_splits
    from convoy.distributed import default_threads
    from convoy.engine.schedule import lr_factor, no_decay_names
    from convoy.models.registry import build_model

    job = load_job(REPO / recipe, overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(job.scaling.threads_per_worker or default_threads(world))
    torch.manual_seed(job.run.seed)
    cuda = torch.cuda.is_available() and job.scaling.use_gpu
    device = torch.device("cuda" if cuda else "cpu")
    splits = load_splits(job.data)
    inputs, targets = (
        torch.stack(column).to(device)
        for column in zip(*(splits.train[i] for i in range(len(splits.train))), strict=True)
    )
    model = build_model(job.model.name, job.model.kwargs, splits.shape).to(device)
    no_decay = no_decay_names(model)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n not in no_decay]},
        {"params": [p for n, p in model.named_parameters() if n in no_decay], "weight_decay": 0},
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=job.optim.lr,
        betas=tuple(job.optim.betas),
        weight_decay=job.optim.weight_decay,
        fused=cuda,
    )
    total = steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, job.optim, total)
    )
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if job.run.compile:
        model = torch.compile(model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.precision)
    share = job.data.batch_size // world
    times: list[float] = []
    loss_value = float("nan")
    order = torch.randperm(len(inputs), device=device)
    cursor = 0
    for _ in range(steps):
        start = time.perf_counter()
        if cursor + job.data.batch_size > len(order):
            order, cursor = torch.randperm(len(inputs), device=device), 0
        index = order[cursor + rank * share : cursor + (rank + 1) * share]
        cursor += job.data.batch_size
        x, y = inputs[index], targets[index]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
        loss.backward()
        if job.optim.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loss_value = loss.item()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    if world > 1:
        dist.destroy_process_group()
    steady = times[WARMUP_STEPS:] or times
    return {"step_s": statistics.median(steady), "loss": loss_value, "peak_bytes": peak}


# ---------------------------------------------------------------------------------------------
# The driver.


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(src), RAY_USAGE_STATS_ENABLED="0")
    return env


def run_convoy(work: Workload, steps: int, src: Path, runs: Path, key: str) -> dict[str, Any]:
    launcher = (
        ["scaling.launcher=torchrun", "strategy.name=ddp", f"scaling.num_workers={work.workers}"]
        if work.workers > 1
        else ["scaling.launcher=local", "strategy.name=single", "scaling.num_workers=1"]
    )
    overrides = [
        *work.overrides,
        *launcher,
        f"run.max_steps={steps}",
        "run.epochs=1000",
        "run.eval_every_epochs=1000",
        "checkpoint.every_epochs=null",
        f"run.storage_dir={runs}",
        f"run.name={key}",
        "run.progress=plain",
    ]
    command = [sys.executable, "-m", "convoy", "train", str(REPO / work.recipe)]
    for item in overrides:
        command += ["-o", item]
    done = subprocess.run(command, env=_env(src), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"convoy failed ({key}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((runs / key / "summary.json").read_text())
    return {
        "step_s": summary["step_seconds_median"],
        "loss": summary["metrics"].get("train/loss"),
        "peak_bytes": max(summary.get("peak_memory_bytes_per_rank") or [0]) or None,
    }


def run_plain(work: Workload, steps: int, src: Path) -> dict[str, Any]:
    args = ["plain", work.recipe, str(steps), *work.overrides]
    if work.workers > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={work.workers}",
            __file__,
            *args,
        ]
    else:
        command = [sys.executable, __file__, *args]
    done = subprocess.run(command, env=_env(src), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"plain loop failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    return dict(json.loads(line))


def measure(args: argparse.Namespace) -> dict[tuple[str, str], list[dict[str, Any]]]:
    trees = [("after", Path(args.src).resolve())]
    if args.before:
        trees.append(("before", Path(args.before).resolve()))
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp:
        runs = Path(tmp)
        for repeat in range(args.repeats):
            for name in args.workloads:
                work = WORKLOADS[name]
                steps = work.steps or args.steps
                plain = run_plain(work, steps, trees[0][1])
                results.setdefault((name, "plain"), []).append(plain)
                print(f"[{repeat}] {name} plain: {plain['step_s'] * 1e3:.3f} ms", flush=True)
                for label, src in trees:
                    key = f"{name}-{label}-{repeat}".replace("_", "-")
                    convoy = run_convoy(work, steps, src, runs, key)
                    results.setdefault((name, label), []).append(convoy)
                    ms = convoy["step_s"] * 1e3
                    print(f"[{repeat}] {name} convoy {label}: {ms:.3f} ms", flush=True)
    return results


def table(results: dict[tuple[str, str], list[dict[str, Any]]], args: argparse.Namespace) -> str:
    labels = ["after", "before"] if args.before else ["after"]
    rows = [
        "| workload | Convoy tree | plain loop (ms/step) | Convoy (ms/step) | Convoy / plain "
        "(speed) | Convoy extra (ms/step) |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.workloads:
        plains = results[(name, "plain")]
        for label in labels:
            convoys = results[(name, label)]
            plain_ms = statistics.median(r["step_s"] for r in plains) * 1e3
            convoy_ms = statistics.median(r["step_s"] for r in convoys) * 1e3
            # Paired per repetition: runs next to each other share the machine's state.
            speed = statistics.median(
                p["step_s"] / c["step_s"] for p, c in zip(plains, convoys, strict=True)
            )
            extra = statistics.median(
                (c["step_s"] - p["step_s"]) * 1e3 for p, c in zip(plains, convoys, strict=True)
            )
            rows.append(
                f"| {WORKLOADS[name].note} | {label} | {plain_ms:.3f} | {convoy_ms:.3f} | "
                f"{speed:.2f}x | {extra:+.3f} |"
            )
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "plain":
        recipe, steps, *overrides = sys.argv[2:]
        result = plain_loop(recipe, overrides, int(steps))
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,mlp-torchrun,gpt_tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--src", default=str(REPO / "src"))
    parser.add_argument("--before", help="another checkout's src/, run interleaved")
    parser.add_argument("--out", type=Path, help="write <out>/loop_overhead_<hw>_<date>.md")
    parser.add_argument("--hardware", default="cpu", help="the file name's hardware tag")
    args = parser.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    results = measure(args)
    header = (
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; Python "
        f"{platform.python_version()}; {args.repeats} repetitions of {args.steps} steps, "
        f"medians (ratios paired per repetition); {date.today()}."
    )
    text = table(results, args)
    print(header)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"loop_overhead_{args.hardware}_{date.today()}.md"
        path.write_text(f"# Loop overhead: Convoy vs a plain loop\n\n{header}\n\n{text}\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
