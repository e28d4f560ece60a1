"""A 1 B Llama folder, as the Hub ships it, loaded shard by shard under fsdp2 x 4, trained, exported.

Question: does a rank of ``fsdp2`` x 4 hold only its share of an ``hf`` model read from a folder
(bf16 on disk, in 3+ safetensors shards with their index), and are the weights transformers'?
Each step runs in a process of its own, so no figure carries another's peak:

1. the folder: ``LlamaForCausalLM`` (hidden 2048, 20 layers, GQA 16/4 heads, SwiGLU 5632,
   vocabulary 32,000, untied head: 1.03 B parameters) saved by transformers in bf16 with
   ``max_shard_size=800MB``;
2. set-up on 4 gloo ranks (``build_skeleton`` + ``fsdp2`` ``wrap``: built on meta, each rank
   reading its rows): seconds and peak RSS per rank, beside a 2-layer Llama folder's (the
   baseline) and beside ``from_pretrained`` in one process;
3. logits: Convoy's model read whole (``build_initial``) against ``from_pretrained``'s;
4. ``convoy train`` on torchrun x 4, 1 step, checkpoint at the end: the summary's set-up and
   run peaks per rank; then ``convoy export --format hf --max-shard-size 1GB`` of that run
   (``benchmarks/export_memory.py`` measures its peak) and the export's logits under
   ``from_pretrained`` against Convoy's checkpoint.

    python benchmarks/hf_folder_1b.py --work /big/tmp [--out benchmarks/]
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
WORKERS = 4
BIG = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
SMALL = {**BIG, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 704}
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src"), "RAY_USAGE_STATS_ENABLED": "0"}


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def step(name: str, *args: str) -> Any:
    """Run ``name`` of this script in a process of its own; its JSON result."""
    out = subprocess.run(
        [sys.executable, __file__, "--step", name, *args],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
    print(f"{name} {' '.join(args)}: {out.stdout.strip().splitlines()[-1]}", flush=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_folder(folder: str, size: str) -> dict[str, Any]:
    import torch
    import transformers

    files = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    if files:  # made by an earlier run of this script: the same seed, the same weights
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            params = sum(
                p.numel()
                for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
            )
        return {"params": params, "files": files}
    config = transformers.LlamaConfig(**(BIG if size == "big" else SMALL))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 2 bytes a parameter here too
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="800MB")
    files = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    return {"params": sum(p.numel() for p in model.parameters()), "files": files}


def rank_load(ctx: Any, folder: str) -> dict[str, Any]:
    import torch

    from convoy.config import load_job
    from convoy.distributed import process_group
    from convoy.models.registry import build_skeleton
    from convoy.strategies import build_strategy

    job = load_job(None, ["strategy.name=fsdp2", f"scaling.num_workers={WORKERS}"])
    strategy = build_strategy(job.strategy, ctx.device, torch.float32, ctx.local_world_size)
    with process_group(ctx, 1800.0):
        before, start = vm_hwm(), time.perf_counter()
        model, weights = build_skeleton("hf", {"path": folder}, {"vocab_size": 256}, 0)
        model = strategy.wrap(model, weights)
        seconds = time.perf_counter() - start
        read = weights.folder.bytes_read if weights is not None and weights.folder else 0
        return {"before": before, "after": vm_hwm(), "seconds": seconds, "read": read}


def sharded_load(folder: str) -> list[dict[str, Any]]:
    from convoy.testing import run_on_gloo

    return run_on_gloo(rank_load, WORKERS, folder)


def hub_load(folder: str) -> dict[str, Any]:
    import torch
    import transformers

    start = time.perf_counter()
    transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {"seconds": time.perf_counter() - start, "peak": vm_hwm()}


def logits(folder: str, run: str = "") -> dict[str, Any]:
    """Convoy's logits (from the folder, or from a run's checkpoint) against transformers'
    ``from_pretrained`` of ``folder`` on the same tokens."""
    import torch
    import transformers

    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if run:
            from convoy.export.consolidate import consolidated_model, read_checkpoint

            ours = consolidated_model(read_checkpoint(run))(tokens)
        else:
            from convoy.models.registry import build_initial

            ours = build_initial("hf", {"path": folder}, {"vocab_size": 256}, 0).eval()(tokens)
        hub = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        theirs = hub.eval()(input_ids=tokens).logits
    return {
        "max_abs_diff": float((ours - theirs).abs().max()),
        "equal": bool(torch.equal(ours, theirs)),
    }


def train(folder: str, storage: str) -> dict[str, Any]:
    # A small text (14 KB, a few documents): one step, then val and test of a few sequences each; the
    # bundled corpus's splits would take a 1 B model hours to evaluate on 2 cores.
    text = Path(storage) / "text.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text((Path(__file__).read_text() * 4)[:14000])
    overrides = [
        "model.name=hf",
        f"model.kwargs={{path: {folder}}}",
        "task.name=language_modeling",
        "data.name=text",
        f"data.path={text}",
        "data.tokenizer=bytes",
        "data.seq_len=16",
        "data.batch_size=4",
        "data.eval_batch_size=4",
        "data.train_size=64",
        "strategy.name=fsdp2",
        f"scaling.num_workers={WORKERS}",
        "scaling.launcher=torchrun",
        "run.max_steps=1",
        "optim.name=sgd",  # no optimizer state: 2 x 1 GB a rank, beside other work
        "checkpoint.every_steps=1",
        f"run.storage_dir={storage}",
        "run.name=llama_1b",
        "run.progress=off",
    ]
    cmd = [sys.executable, "-m", "convoy", "train", *(x for o in overrides for x in ("-o", o))]
    start = time.perf_counter()
    subprocess.run(cmd, env=ENV, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((Path(storage) / "llama_1b" / "summary.json").read_text())
    return {
        "command_seconds": time.perf_counter() - start,
        "setup": summary["setup_peak_memory_bytes_per_rank"],
        "peak": summary["peak_memory_bytes_per_rank"],
        "loss": summary["metrics"].get("train/loss"),
    }


STEPS = {
    "make_folder": make_folder,
    "sharded_load": sharded_load,
    "hub_load": hub_load,
    "logits": logits,
    "train": train,
}


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/convoy-hf-1b"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.step:
        print(json.dumps(STEPS[args.step](*rest)))
        return
    big, small = args.work / "llama_1b", args.work / "llama_small"
    made = step("make_folder", str(big), "big")
    if not (small / "config.json").is_file():
        step("make_folder", str(small), "small")
    base = step("sharded_load", str(small))
    load = step("sharded_load", str(big))
    hub = step("hub_load", str(big))
    check = step("logits", str(big))
    trained = step("train", str(big), str(args.work / "runs"))
    run = args.work / "runs" / "llama_1b"
    export = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "export_memory.py"),
            str(run),
            "--format",
            "hf",
            "--max-shard-size",
            "1GB",
            "--work",
            str(args.work),
        ],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    exported = args.work / "exported"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "convoy",
            "export",
            str(run),
            "--format",
            "hf",
            "--max-shard-size",
            "1GB",
            "--out",
            str(exported),
        ],
        env=ENV,
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    params = made["params"]
    fp32 = params * 4
    baseline = max(r["after"] for r in base)
    bound = baseline + fp32 / WORKERS * 1.2
    peaks = [r["after"] for r in load]
    lines = [
        f"Folder: {params / 1e9:.3f} B parameters, bf16, {len(made['files'])} files "
        f"({', '.join(made['files'])}); fp32 {gib(fp32)} GiB.",
        "",
        "| what | per rank | seconds | bound GiB | within |",
        "|---|---|---|---|---|",
        f"| set-up peak RSS GiB, 2-layer baseline | {', '.join(gib(r['after']) for r in base)} "
        f"| {max(r['seconds'] for r in base):.1f} | | |",
        f"| set-up peak RSS GiB, 1 B folder, fsdp2 x 4 | {', '.join(gib(p) for p in peaks)} | "
        f"{max(r['seconds'] for r in load):.1f} | {gib(bound)} | "
        f"{'yes' if max(peaks) <= bound else 'no'} |",
        f"| bytes read per rank GiB (bf16 on disk) | {', '.join(gib(r['read']) for r in load)} "
        "| | | |",
        f"| from_pretrained in one process (fp32) | peak {gib(hub['peak'])} | "
        f"{hub['seconds']:.1f} | | |",
        f"| `convoy train` torchrun x 4, set-up peak | {', '.join(gib(b) for b in trained['setup'])} "
        f"| {trained['command_seconds']:.0f} (whole command) | {gib(bound)} | "
        f"{'yes' if max(trained['setup']) <= bound else 'no'} |",
        f"| `convoy train`, run peak (1 step + checkpoint) | "
        f"{', '.join(gib(b) for b in trained['peak'])} | | | |",
        "",
        f"Logits, Convoy's model read from the folder vs `from_pretrained` (fp32): max |diff| "
        f"{check['max_abs_diff']:.3g}, bitwise equal: {check['equal']}.",
    ]
    if exported.is_dir():
        again = step("logits", str(exported), str(run))
        lines.append(
            f"Logits, the 1GB-sharded `--format hf` export under `from_pretrained` vs Convoy's "
            f"checkpoint: max |diff| {again['max_abs_diff']:.3g}, bitwise equal: {again['equal']}."
        )
    lines += [
        "",
        "`convoy export` of the run (benchmarks/export_memory.py):",
        "",
        export.stdout[-3000:],
    ]
    header = (
        f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; each step "
        "in a process of its own; RSS = VmHWM (pages touched). Bound: the baseline's set-up peak "
        "+ fp32 model / 4 x 1.2."
    )
    from dated import publish

    publish(
        args.out, "hf_folder_1b", "A 1 B Llama folder under fsdp2 x 4", header, "\n".join(lines)
    )


if __name__ == "__main__":
    main()
