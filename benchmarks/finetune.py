"""Fine-tuning on the CPU: LoRA vs full fine-tuning, and packed vs padded SFT rows.

Two questions, each measured in one run of this script, with ``convoy train`` (torchrun x 2,
``fsdp2``) on a Llama folder made offline (``examples/chat_model.py``'s tokenizer and chat
template, a Llama of hidden 256 and 4 layers saved beside them, untrained):

a. LoRA (r 8 on every attention and MLP projection, as ``recipes/chat_lora.yaml``) vs full
   fine-tuning of the same folder, on the same SFT rows (``examples/conversations.jsonl``,
   packed) and batch: peak memory per rank (set-up and run, the summary's VmHWM), tokens/s
   (trained tokens), trainable parameters, the checkpoint's size on disk;
b. packed vs padded rows (``data.packing``) on conversations of widely mixed length (1 to 6
   question/answer pairs, most of them short, generated here), same model (full fine-tuning):
   trained tokens/s (the task counts targets that are not -100: never padding) and real
   (non-padding) tokens/s.

The variants alternate (A, B, B, A, twice by default: ``--rounds``) so that the machine's other
load falls on both; each variant's figure is the median of its runs, and each run's is listed
beside it, with the load average when it ended. The steady rate is the
summary's: the global batch over the median step after the first 3, times the trained tokens a
row held on average over the run.

    python benchmarks/finetune.py [--work /tmp/convoy-finetune] [--steps 30] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
WORKERS = 2
SEQ_LEN = 256
BATCH = 8
LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ_LEN,
    "tie_word_embeddings": False,
}
"""The model: 4 layers of hidden 256 (about 3.4 M parameters with the 512-token vocabulary)."""
LORA = (
    "model.lora={r: 8, alpha: 16, target_modules: "
    "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
)
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src"), "RAY_USAGE_STATS_ENABLED": "0"}


# --- the model folder and the rows -----------------------------------------------------------


def make_folder(folder: Path) -> dict[str, Any]:
    """The chat example's tokenizer and template, and a bigger untrained Llama of its
    vocabulary saved over its tiny one; the parameter count and vocabulary."""
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "examples"))
    from chat_model import make_folder as make_chat_folder

    make_chat_folder(folder, pretrain_steps=0)  # the tokenizer: what takes the time
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **LLAMA,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(folder))
    return {"params": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)}


def mixed_rows(count: int = 1200, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations of 1 to 6 question/answer pairs (the chat example's sums and unit
    conversions, after its system turn), most short: a pair count k drawn with weight 1/k."""
    sys.path.insert(0, str(REPO / "examples"))
    from chat_model import conversation

    rng = random.Random(seed)
    pairs = list(range(1, 7))  # 7 would pass seq_len 256: rows are never cut here
    rows = []
    for _ in range(count):
        k = rng.choices(pairs, weights=[1 / p for p in pairs])[0]
        drawn = [conversation(rng)["messages"] for _ in range((k + 1) // 2)]
        turns = [m for messages in drawn for m in messages[1:]][: 2 * k]
        rows.append({"messages": [drawn[0][0], *turns]})
    return rows


def row_lengths(folder: Path, path: Path) -> list[int]:
    """Each row's tokens under the folder's chat template."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [
        len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False))
        for r in rows
    ]


def trainable(folder: Path, vocab: int) -> dict[str, int]:
    """Trainable and all parameters of the model as the engine builds it, with and without
    the adapters (``trainable_counts``: PEFT's ``print_trainable_parameters`` figures)."""
    from convoy.config import load_job
    from convoy.models.lora import trainable_counts
    from convoy.models.registry import build_initial

    job = load_job(None, ["model.name=hf", f"model.kwargs={{path: {folder}}}", LORA])
    shape = {"vocab_size": vocab}
    lora = build_initial("hf", job.model.kwargs, shape, 0, job.model.lora)
    full = build_initial("hf", job.model.kwargs, shape, 0)
    (lora_trainable, lora_all), (full_trainable, _) = trainable_counts(lora), trainable_counts(full)
    return {"lora_trainable": lora_trainable, "lora_all": lora_all, "full": full_trainable}


def prepare(work: str) -> dict[str, Any]:
    """The folder, the mixed rows, their lengths and the parameter counts."""
    root = Path(work)
    folder, mixed = root / "model", root / "mixed.jsonl"
    made = make_folder(folder)
    mixed.write_text("".join(json.dumps(row) + "\n" for row in mixed_rows()))
    return {
        **made,
        **trainable(folder, made["vocab"]),
        "lengths": row_lengths(folder, mixed),
        "bundled_lengths": row_lengths(folder, REPO / "examples" / "conversations.jsonl"),
    }


# --- the runs --------------------------------------------------------------------------------


def job_overrides(work: Path, name: str, data: Path, steps: int, *extra: str) -> list[str]:
    """A fine-tuning job on the folder: ``fsdp2`` x 2 on torchrun, ``steps`` steps."""
    folder = work / "model"
    return [
        "task.name=language_modeling",
        "model.name=hf",
        f"model.kwargs={{path: {folder}}}",
        "data.name=sft",
        f"data.path={data}",
        f"data.tokenizer_path={folder}",
        f"data.seq_len={SEQ_LEN}",
        f"data.batch_size={BATCH}",
        f"data.eval_batch_size={BATCH}",
        "data.val_fraction=0.02",  # the question is training: a small val and test
        "data.test_fraction=0.02",
        "optim.name=adamw",
        "optim.lr=1e-3",
        "strategy.name=fsdp2",
        f"scaling.num_workers={WORKERS}",
        "scaling.launcher=torchrun",
        f"run.max_steps={steps}",
        "run.log_every_steps=10",
        "run.progress=off",
        f"run.storage_dir={work / 'runs'}",
        f"run.name={name}",
        *extra,
    ]


def train(overrides: list[str], env: dict[str, str]) -> dict[str, Any]:
    """``convoy train`` with ``overrides`` and ``env`` added to the environment (its workers
    inherit it); its summary, the command's seconds and its checkpoint's bytes on disk."""
    values = dict(o.split("=", 1) for o in overrides)
    run = Path(values["run.storage_dir"]) / values["run.name"]
    shutil.rmtree(run, ignore_errors=True)  # an earlier run's checkpoint would be resumed
    cmd = [sys.executable, "-m", "convoy", "train", *(x for o in overrides for x in ("-o", o))]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**ENV, **env}, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"convoy train failed:\n{done.stderr[-4000:]}")
    seconds = time.perf_counter() - start
    summary: dict[str, Any] = json.loads((run / "summary.json").read_text())
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    summary["checkpoint_bytes"] = (
        sum(f.stat().st_size for f in checkpoints[-1].rglob("*") if f.is_file())
        if checkpoints
        else None
    )
    summary["command_seconds"] = seconds
    summary["load_average"] = os.getloadavg()[0]  # the machine's other work, over the last minute
    print(
        f"{values['run.name']}: {summary['steady_tokens_per_second']:,.0f} tokens/s steady, "
        f"step {summary['step_seconds_median']:.3f} s, peak "
        f"{[round(b / MIB) for b in summary['peak_memory_bytes_per_rank']]} MiB, "
        f"{seconds:.0f} s, load {summary['load_average']:.2f}",
        flush=True,
    )
    return summary


Variant = tuple[Path, list[str]]
"""A variant's rows and the overrides it adds to ``job_overrides``."""

MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc's mmap threshold fixed at 64 KiB: every tensor over it is its own mapping, returned to
the system when freed, so that the resident set follows the live tensors. By default glibc
raises the threshold after the first large frees and keeps later ones in its heap: the peak
resident set then also counts memory freed but kept (its shape depends on the allocations'
sizes and order, not only on what is live)."""


def alternate(
    work: Path, steps: int, variants: dict[str, Variant], rounds: int, env: dict[str, str]
) -> dict[str, list[Any]]:
    """Each of two variants twice a round, A B B A; their summaries by variant."""
    a, b = variants
    runs: dict[str, list[Any]] = {a: [], b: []}
    tag = "_mmap" if env else ""
    for index, variant in enumerate((a, b, b, a) * rounds):
        data, extra = variants[variant]
        name = f"{variant}{tag}_{index}"
        runs[variant].append(train(job_overrides(work, name, data, steps, *extra), env))
    return runs


# --- the report ------------------------------------------------------------------------------

Row = tuple[str, str, float, str, Callable[[list[float]], float]]
"""A table row: what, the summary's key (or one ``derive`` adds), a divisor, a format, and
what a variant's figure is of its runs' (their median; the fastest run's: ``max``)."""

MEDIAN = statistics.median

LORA_ROWS: list[Row] = [
    ("trainable parameters", "trainable", 1, ",.0f", MEDIAN),
    ("steady tokens/s (trained)", "steady_tokens_per_second", 1, ",.0f", MEDIAN),
    ("steady tokens/s, the fastest run", "steady_tokens_per_second", 1, ",.0f", max),
    ("whole-run tokens/s (trained)", "tokens_per_second", 1, ",.0f", MEDIAN),
    ("median step s", "step_seconds_median", 1, ".3f", MEDIAN),
    ("load average (1 min) at the run's end", "load_average", 1, ".2f", MEDIAN),
    ("set-up peak MiB (largest rank)", "setup_peak_memory_bytes_per_rank", MIB, ",.0f", MEDIAN),
    ("run peak MiB (largest rank)", "peak_memory_bytes_per_rank", MIB, ",.0f", MEDIAN),
    ("run peak above set-up MiB (largest rank)", "above_setup_bytes", MIB, ",.1f", MEDIAN),
    ("weights + grads + AdamW MiB a rank (computed)", "state_bytes", MIB, ",.1f", MEDIAN),
    ("checkpoint on disk MiB", "checkpoint_bytes", MIB, ",.2f", MEDIAN),
]
MEMORY_ROWS = [row for row in LORA_ROWS if "MiB" in row[0] or "step" in row[0]]
PACKING_ROWS: list[Row] = [
    (f"train rows of {SEQ_LEN} tokens", "train_rows", 1, ",.0f", MEDIAN),
    ("steady trained tokens/s", "steady_tokens_per_second", 1, ",.0f", MEDIAN),
    ("steady trained tokens/s, the fastest run", "steady_tokens_per_second", 1, ",.0f", max),
    ("steady real tokens/s (split average)", "real_tokens_per_second", 1, ",.0f", MEDIAN),
    ("whole-run trained tokens/s", "tokens_per_second", 1, ",.0f", MEDIAN),
    ("median step s", "step_seconds_median", 1, ".3f", MEDIAN),
    ("load average (1 min) at the run's end", "load_average", 1, ".2f", MEDIAN),
    ("run peak MiB (largest rank)", "peak_memory_bytes_per_rank", MIB, ",.0f", MEDIAN),
]


def derive(run: dict[str, Any], params: tuple[int, int]) -> dict[str, Any]:
    """The figures a run's summary gives only in parts: the largest rank's run peak above its
    set-up peak; real (non-padding) tokens/s, the steady rows/s times the real tokens a train
    row holds on average (``sft_rows``: the split's tokens over its rows of ``seq_len``); the
    bytes of a rank's share of the state, from ``params`` (trainable, all): fp32 weights, and
    a gradient and AdamW's two moments for each trainable one, sharded by fsdp2."""
    trainable, total = params
    counts = run["sft_rows"]["train"]
    peaks = zip(
        run["peak_memory_bytes_per_rank"], run["setup_peak_memory_bytes_per_rank"], strict=True
    )
    return {
        **run,
        "trainable": trainable,
        "train_rows": counts["rows_of_tokens"],
        "above_setup_bytes": max(peak - setup for peak, setup in peaks),
        "state_bytes": (4 * total + 12 * trainable) / run["world_size"],
        "real_tokens_per_second": run["steady_samples_per_second"]
        * counts["tokens"]
        / counts["rows_of_tokens"],
    }


def value(run: dict[str, Any], key: str) -> float:
    """A run's figure; of a per-rank list, the largest rank's."""
    figure = run[key]
    return float(max(figure) if isinstance(figure, list) else figure)


def table(runs: dict[str, list[dict[str, Any]]], rows: list[Row]) -> list[str]:
    """Variant A beside B (their medians), B / A, and each run's figure (A's, then B's)."""
    a, b = runs
    lines = [f"| | {a} | {b} | {b} / {a} | each run ({a}; {b}) |", "|---|---|---|---|---|"]
    for what, key, scale, fmt, pick in rows:
        each = {v: [value(r, key) / scale for r in runs[v]] for v in (a, b)}
        mid = {v: pick(each[v]) for v in (a, b)}
        shown = "; ".join(", ".join(f"{x:{fmt}}" for x in each[v]) for v in (a, b))
        if pick is not MEDIAN or all(len(set(each[v])) == 1 for v in (a, b)):
            shown = ""  # listed on the row above, or the same in every run of a variant
        lines.append(
            f"| {what} | {mid[a]:{fmt}} | {mid[b]:{fmt}} | {mid[b] / mid[a]:.3f} | {shown} |"
        )
    return lines


def per_rank_line(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Every rank's run peak, each run, in MiB."""
    return "Run peak per rank MiB: " + "; ".join(
        f"{variant} {', '.join(f'{b / MIB:,.0f}' for b in r['peak_memory_bytes_per_rank'])}"
        for variant in runs
        for r in runs[variant]
    )


def lengths_line(lengths: list[int]) -> str:
    ordered = sorted(lengths)
    return (
        f"{len(ordered)} rows, tokens min {ordered[0]}, median {statistics.median(ordered):.0f}, "
        f"mean {statistics.mean(ordered):.0f}, p90 {ordered[int(0.9 * len(ordered))]}, "
        f"max {ordered[-1]}"
    )


def hardware() -> str:
    """The machine in a line: CPU model, cores, memory, Python and torch."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = next(
        int(line.split()[1]) * 1024 / 2**30
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    import torch

    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB; Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def command_lines(work: Path, steps: int) -> list[str]:
    """The commands, as the runs ran them (the first run of each question; the other variant
    adds or drops the override named)."""
    full = job_overrides(
        work,
        "full_0",
        REPO / "examples" / "conversations.jsonl",
        steps,
        f"checkpoint.every_steps={steps}",
    )
    packed = job_overrides(work, "packed_1", work / "mixed.jsonl", steps)
    return [
        "```bash",
        "convoy train " + " ".join(f"-o '{o}'" for o in full) + f"   # LoRA: -o '{LORA}'",
        "convoy train "
        + " ".join(f"-o '{o}'" for o in packed)
        + "   # padded: -o data.packing=false",
        "```",
    ]


def run_questions(work: Path, steps: int, rounds: int) -> dict[str, dict[str, list[Any]]]:
    """Both questions' runs, A B B A ``rounds`` times each: a. full then LoRA on the bundled
    rows, a checkpoint at the last step, then once more A B B A under ``MMAP_THRESHOLD``; b.
    padded then packed on the mixed rows. Their summaries, also kept whole in
    ``work/summaries.json``."""
    bundled, mixed = REPO / "examples" / "conversations.jsonl", work / "mixed.jsonl"
    last = f"checkpoint.every_steps={steps}"
    lora: dict[str, Variant] = {"full": (bundled, [last]), "lora": (bundled, [last, LORA])}
    packing: dict[str, Variant] = {
        "padded": (mixed, ["data.packing=false"]),
        "packed": (mixed, []),
    }
    runs = {
        "lora": alternate(work, steps, lora, rounds, {}),
        "lora_mmap": alternate(work, steps, lora, 1, MMAP_THRESHOLD),
        "packing": alternate(work, steps, packing, rounds, {}),
    }
    (work / "summaries.json").write_text(json.dumps(runs, indent=1))
    return runs


def header(made: dict[str, Any], steps: int, rounds: int) -> str:
    return (
        f"{hardware()}. `convoy train`, `fsdp2` x {WORKERS} on torchrun (gloo), fp32, "
        f"{steps} steps a run, global batch {BATCH} rows of {SEQ_LEN} tokens, AdamW; "
        f"model: the chat example's tokenizer (vocabulary {made['vocab']}) and template, a "
        f"Llama of hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} layers, MLP "
        f"{LLAMA['intermediate_size']}, untied head: {made['params']:,} parameters. Runs "
        f"alternate A B B A ({rounds} x); figures are medians of the {2 * rounds} runs of a "
        "variant; peaks are VmHWM (RSS) of the largest rank."
    )


def report(
    made: dict[str, Any], runs: dict[str, dict[str, list[Any]]], work: Path, steps: int
) -> list[str]:
    """The two tables, the inputs' lengths and the commands."""
    full = (made["full"], made["full"])
    counts = {"full": full, "lora": (made["lora_trainable"], made["lora_all"])}
    lora, mmap, packing = (
        {v: [derive(r, counts.get(v, full)) for r in rs] for v, rs in runs[question].items()}
        for question in ("lora", "lora_mmap", "packing")
    )
    return [
        f"## a. LoRA vs full fine-tuning ({LORA.split('=', 1)[1]})",
        "",
        f"Rows: examples/conversations.jsonl, packed ({lengths_line(made['bundled_lengths'])}).",
        "",
        *table(lora, LORA_ROWS),
        "",
        per_rank_line(lora),
        "",
        "The same, once more A B B A, with glibc's mmap threshold fixed at 64 KiB "
        "(`MALLOC_MMAP_THRESHOLD_=65536` in the command's environment, which its workers "
        "inherit): the resident set then follows the live tensors.",
        "",
        *table(mmap, MEMORY_ROWS),
        "",
        "## b. Packed vs padded, conversations of mixed length (full fine-tuning)",
        "",
        f"Rows: generated, 1-6 question/answer pairs, weight 1/k "
        f"({lengths_line(made['lengths'])}).",
        "",
        *table(packing, PACKING_ROWS),
        "",
        "## Commands",
        "",
        *command_lines(work, steps),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/convoy-finetune"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="A B B A, this many times")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.step:  # in a process of its own: the driver stays small
        print(json.dumps({"prepare": prepare}[args.step](*rest)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [sys.executable, __file__, "--step", "prepare", str(args.work)],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    made = json.loads(out.stdout.strip().splitlines()[-1])
    runs = run_questions(args.work, args.steps, args.rounds)
    from dated import publish

    publish(
        args.out,
        "finetune",
        "Fine-tuning on the CPU: LoRA vs full, packed vs padded",
        header(made, args.steps, args.rounds),
        "\n".join(report(made, runs, args.work, args.steps)),
    )


if __name__ == "__main__":
    main()
