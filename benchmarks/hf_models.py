"""Hugging Face models beside Convoy's own of about the same size, on CPU.

Question: what does training a ``transformers`` model (``model.name: hf``) cost against
Convoy's own model of about the same size, and does it learn as well? Two pairs, each run in
one process (the local launcher, every core), fp32, alternating over the repeats so machine
noise hits both alike:

- language modeling on the embedded pydoc corpus (``recipes/lm_tiny.yaml``: BPE 2,048 tokens,
  128-token sequences, batch 32): ``gpt_tiny`` (4 blocks, hidden 128, LayerNorm, GELU MLP,
  learned positions) against a Llama-shaped model (``recipes/lm_llama_hf.yaml``: 4 blocks,
  hidden 128, grouped-query attention, RMSNorm, SwiGLU, rotary; head tied as gpt_tiny's);
  steady tokens/s (median step after warm-up) over ``--steps`` steps, dropout off;
- image classification on the digits (``recipes/default.yaml`` against
  ``recipes/digits_vit_hf.yaml``: the same ViT shape, Convoy's and ``transformers``'), the
  whole recipe (50 epochs), test accuracy and loss.

    python benchmarks/hf_models.py [--steps 40] [--repeats 2] [--epochs 50] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

import convoy
from convoy.config import load_job
from convoy.models.registry import count_parameters
from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
ONE_PROCESS = ["strategy={name: single}", "scaling.launcher=local", "scaling.num_workers=1"]
LM = {
    "gpt_tiny": ("lm_tiny.yaml", ["model.kwargs.dropout=0.0"]),
    "hf llama": ("lm_llama_hf.yaml", ["model.kwargs.config.tie_word_embeddings=true"]),
}
DIGITS = {"vit_tiny": "default.yaml", "hf vit": "digits_vit_hf.yaml"}


def train(recipe: str, extra: list[str], storage: Path, name: str) -> dict:
    job = load_job(
        REPO / "recipes" / recipe,
        [
            *extra,
            *ONE_PROCESS,
            "run.progress=off",
            f"run.storage_dir={storage}",
            f"run.name={name}",
        ],
    )
    result = convoy.train(job)
    if recipe not in PARAMETERS:  # once per model: counting loads the data again
        PARAMETERS[recipe] = parameters(job)
    tokens = job.data.batch_size * job.data.seq_len  # a step's tokens (text)
    return result.summary | {"params": PARAMETERS[recipe], "tokens_per_step": tokens}


PARAMETERS: dict[str, int] = {}
"""Each recipe's parameter count (the model on the meta device)."""


def parameters(job) -> int:  # type: ignore[no-untyped-def]
    from convoy.data.registry import load_splits
    from convoy.models.registry import build_model

    shape = load_splits(job.data).shape
    with torch.device("meta"):
        model = build_model(job.model.name, job.model.kwargs, shape)
    return count_parameters(model)


def throughput_rows(storage: Path, steps: int, repeats: int) -> list[str]:
    runs: dict[str, list[dict]] = {model: [] for model in LM}
    for index in range(repeats):
        for model in LM if index % 2 == 0 else reversed(list(LM)):
            recipe, extra = LM[model]
            limit = [*extra, f"run.max_steps={steps}", "run.log_every_steps=1"]
            runs[model].append(
                train(recipe, limit, storage, f"lm-{model.replace(' ', '-')}-{index}")
            )

    # Each run's median step, then the median over the repeats; tokens/s from that step.
    def steady(results: list[dict]) -> tuple[float, float]:
        step = statistics.median(r["step_seconds_median"] for r in results)
        return step, results[0]["tokens_per_step"] / step

    base = steady(runs["gpt_tiny"])[1]
    rows = []
    for model, results in runs.items():
        step, rate = steady(results)
        rows.append(
            f"| {model} | {results[0]['params'] / 1e6:.2f} M | {1000 * step:.1f} | "
            f"{rate:,.0f} | {rate / base:.3f} |"
        )
    return rows


def accuracy_rows(storage: Path, epochs: int) -> list[str]:
    rows = []
    for model, recipe in DIGITS.items():
        summary = train(
            recipe, [f"run.epochs={epochs}"], storage, f"digits-{model.replace(' ', '-')}"
        )
        metrics = summary["metrics"]
        rows.append(
            f"| {model} | {summary['params'] / 1e6:.3f} M | {metrics['test/acc']:.4f} | "
            f"{metrics['test/loss']:.4f} | {summary['wall_seconds']:.0f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--parts", default="lm,digits", help="lm, digits or both")
    parser.add_argument("--out", type=Path, default=None, help="write a dated markdown here")
    args = parser.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="convoy-hf-") as tmp:
        if "lm" in args.parts:
            lines += [
                "Language modeling, pydoc corpus, batch 32 x 128 tokens:",
                "",
                "| model | parameters | step (ms) | steady tokens/s | vs gpt_tiny |",
                "|---|---|---|---|---|",
                *throughput_rows(Path(tmp), args.steps, args.repeats),
                "",
            ]
        if "digits" in args.parts:
            lines += [
                f"Digits, {args.epochs} epochs, batch 32, seed 0:",
                "",
                "| model | parameters | test acc | test loss | wall (s) |",
                "|---|---|---|---|---|",
                *accuracy_rows(Path(tmp), args.epochs),
            ]
    table = "\n".join(lines).rstrip()
    header = (
        f"{date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, fp32, one process; LM: {args.steps} steps, {args.repeats} "
        "repeats (medians)"
    )
    publish(args.out, "hf_models", "Hugging Face models beside Convoy's (CPU)", header, table)


if __name__ == "__main__":
    main()
