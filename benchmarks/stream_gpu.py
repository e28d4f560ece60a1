"""Streamed data on one GPU: does the torch loader's stream of parquet row groups keep a GPU
fed? Data wait and rates of streamed sources against in-memory ones, on one GPU.

    python3 benchmarks/stream_gpu.py --out "$OUT"          # on a CUDA machine
    python3 benchmarks/stream_gpu.py --out /tmp/x --quick  # CPU dry run of every command

1. Telematics (``convoy data synth-telematics``, in each of ``--layouts``: list<float32>
   channels or packed float32 bytes), conv1d, ``single``: the recipe's batch (64) and a
   GPU-sized one (1,024). The series source is streamed only: the figures are its data wait
   and its rate, and the reader's rate alone (the train split streamed with nothing training).
2. gpt_small on one text corpus (the pydoc topics, each copied ``--copies`` times with its copy
   number, UTF-8 bytes as tokens), fsdp2 world 1 under torchrun, bf16: streamed from parquet
   shards (tokenized and packed in a background thread of the rank) against the same
   documents read whole from one parquet file.

Uses the checklist's runner (``gpu_checklist.Checklist``): every step a subprocess with a time
limit, recorded in ``checklist.log`` and ``results.json``; ``table.md`` is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checklist import GPT_SMALL, LM, Checklist

TELEMATICS = "recipes/telematics_stream.yaml"
READER_ALONE = """
import json, sys, time
from convoy.config import DataConfig
from convoy.data.registry import load_splits
from convoy.data.streaming import StreamedTrainBatches
splits = load_splits(DataConfig(name="series", path=sys.argv[1]))
batch = min(1024, len(splits.train))
batches = StreamedTrainBatches(splits.train, batch, batch, 1, 0, 0, 4)
rows, start = 0, time.perf_counter()
for epoch in range(3):
    batches.start_epoch(epoch)
    rows += sum(len(x) for x, _ in batches)
print(json.dumps({"rows_per_second": rows / (time.perf_counter() - start)}))
"""
"""The torch loader's stream of the train split alone (no training), batches of 1,024."""


def write_corpus(root: Path, copies: int, rows_per_group: int) -> tuple[Path, Path]:
    """The pydoc topics, ``copies`` times over, as shards (train/ val/ test/) and as one
    parquet file of the same documents (the in-memory source splits it by its own rule)."""
    from pydoc_data.topics import topics

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"{topics[name]}\n[copy {c}]" for c in range(copies) for name in sorted(topics)]
    held = max(2, len(docs) // 50)
    splits = {"test": docs[:held], "val": docs[held : 2 * held], "train": docs[2 * held :]}
    for split, rows in splits.items():
        (root / "shards" / split).mkdir(parents=True)
        table = pa.table({"text": rows})
        pq.write_table(
            table, root / "shards" / split / "part-0.parquet", row_group_size=rows_per_group
        )
    whole = root / "whole.parquet"
    pq.write_table(pa.table({"text": docs}), whole)
    return root / "shards", whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "stream-gpu-out"))
    parser.add_argument("--quick", action="store_true", help="tiny CPU sizes: check the commands")
    parser.add_argument("--deadline", type=float, default=400.0, help="seconds for everything")
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--steps", default="telematics,text", help="','-separated")
    parser.add_argument("--batches", default="64,1024", help="telematics global batches")
    parser.add_argument("--epochs", type=int, default=2, help="telematics epochs")
    parser.add_argument("--layouts", default="lists", help="telematics layouts: lists,packed")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    c = Checklist(out, args.quick, args.deadline)
    data = c.runs / "data"
    quick = args.quick

    devices, hours = (6, 0.1) if quick else (args.devices, args.hours)
    steps = args.steps.split(",")
    if "telematics" in steps:
        for layout in args.layouts.split(","):
            telematics(c, data / f"fleet-{layout}", layout, (devices, hours), args)
    if "text" not in steps:
        return finish(c, out, quick)

    shards, whole = write_corpus(data / "text", 2 if quick else args.copies, 64)
    gpt = [*GPT_SMALL, "precision=bf16", f"run.max_steps={4 if quick else 60}"]
    if quick:
        gpt += ["model.name=gpt_tiny", "model.kwargs.vocab_size=512", "data.seq_len=128"]
    batch = 16
    for key, path in (("text_streamed", shards), ("text_in_memory", whole)):
        c.train(key, LM, [*gpt, f"data.path={path}"], 200, batch)

    return finish(c, out, quick)


def telematics(
    c: Checklist, fleet: Path, layout: str, size: tuple[float, float], args: argparse.Namespace
) -> None:
    """Write the fleet in ``layout``, stream it alone, then train on it at each batch."""
    devices, hours = size
    began = time.monotonic()
    layout_args = ["--layout", layout] if layout != "lists" else []  # older trees: lists only
    c.convoy(f"synth_telematics_{layout}", ["data", "synth-telematics", str(fleet), "--devices",
             str(devices), "--hours", str(hours), *layout_args], 150)  # fmt: skip
    c.results[f"fleet_seconds_{layout}"] = round(time.monotonic() - began, 1)
    rc, text = c.run(
        f"reader_alone_{layout}", [sys.executable, "-c", READER_ALONE, str(fleet)], 120
    )
    if rc == 0:
        rate = json.loads(text.strip().splitlines()[-1])["rows_per_second"]
        c.results.setdefault("reader_rows_per_second", {})[layout] = rate
    single = ["scaling.launcher=local", "scaling.num_workers=1", "strategy.name=single",
              f"data.path={fleet}", f"run.epochs={args.epochs}",
              "checkpoint.every_epochs=null"]  # fmt: skip
    for batch in map(int, args.batches.split(",")):
        c.train(f"telematics_{layout}_b{batch}", TELEMATICS,
                [*single, f"data.batch_size={batch}"], 150, batch)  # fmt: skip


def finish(c: Checklist, out: Path, quick: bool) -> int:
    """Print and write the table of every run that left a summary."""
    rows = []
    for key, step in c.results["steps"].items():
        summary: dict[str, Any] = step.get("summary") or {}
        if not summary:
            continue
        rate = summary.get("tokens_per_second") or summary.get("samples_per_second")
        steady = summary.get("samples_per_second_steady")
        if key.startswith("text") and steady:
            steady *= 1024 if not quick else 128  # sequences/s -> tokens/s
        wait = summary.get("data_wait_fraction")
        first, after = (
            summary.get("first_batch_seconds"),
            summary.get("data_wait_fraction_after_first"),
        )
        metrics = summary.get("metrics", {})
        quality = metrics.get("test/acc", metrics.get("test/bpb"))
        rows.append(
            f"| {key} | {rate or 0:,.0f} | {steady or 0:,.0f} | "
            f"{100 * (wait or 0):.1f}% | {'-' if first is None else f'{first:.2f} s'} | "
            f"{'-' if after is None else f'{100 * after:.1f}%'} | "
            f"{quality if quality is None else round(quality, 4)} |"
        )
    header = (
        "| run | rate (whole run, /s) | steady rate (median step, /s) | data wait | "
        "first batch | data wait after it | test |"
    )
    table = "\n".join([header, "|---|---|---|---|---|---|---|", *rows])
    for layout, rate in c.results.get("reader_rows_per_second", {}).items():
        table += f"\n\nreader alone, {layout}: {rate:,.0f} rows/s"
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(c.results, indent=1, default=str))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
