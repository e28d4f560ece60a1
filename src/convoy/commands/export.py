"""``convoy export RUN_DIR [--checkpoint step_N] [--format safetensors|hf|peft] [--merge]``
``[--max-shard-size 5GB]``:
one checkpoint, consolidated from its shards, as a single-device model.safetensors plus
model.json, or (for ``model.name: hf`` runs) as a folder ``transformers`` loads; a LoRA
run's adapters as PEFT saves them (``--format peft``), or merged (``--format hf --merge``,
which builds the whole model in one process). Weights over
``--max-shard-size`` are split into ``model-0000k-of-0000n.safetensors`` with their index;
they stream from the checkpoint a file at a time, so the memory it takes is one file's.
Without ``--checkpoint`` it takes the run's best checkpoint where the run ranks them
(``checkpoint.keep_best``), else its latest, and says which and why in one line first."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from convoy.errors import ConvoyError
from convoy.storage import is_remote

FORMATS = ("safetensors", "hf", "peft")
"""``--format`` choices (``convoy.export`` names them too; it is imported only to export)."""

MAX_SHARD_SIZE = "5GB"
"""``--max-shard-size``'s default, ``transformers``' own (``convoy.export`` names it too)."""


def add_parser(commands: Any) -> None:
    """Add the ``export`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "export",
        help="export a checkpoint to one safetensors file or a transformers folder",
        description="Consolidate a run's checkpoint (sharded by any strategy and world size) "
        "on one CPU device and write it with model.json (the job, its data's shape and the "
        "recorded metrics) beside it; convoy evaluate takes either export. The weights are "
        "read from the checkpoint and written one file at a time: the memory it takes is "
        "about one --max-shard-size file, not the model.",
    )
    parser.add_argument(
        "run", help="the run directory, <run.storage_dir>/<run.name> (a path or s3:// URI)"
    )
    parser.add_argument(
        "--checkpoint",
        help="a checkpoint name like step_00000312 (default: the best by "
        "checkpoint.best_metric where the run keeps its best ones, checkpoint.keep_best; "
        "else the latest)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors (default, any model): model.safetensors under Convoy's keys, "
        "loadable with plain PyTorch; hf (model.name: hf runs): a save_pretrained folder "
        "(config.json, model.safetensors, the tokenizer that made the training ids) that "
        "transformers' auto classes and AutoTokenizer load; peft (model.lora runs): "
        "adapter_config.json and adapter_model.safetensors, the adapters alone, which "
        "PeftModel.from_pretrained loads over the base folder (model.kwargs.path; a gpt "
        "run's: over Convoy's model of the run, its seeded init)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --format hf, for a model.lora run: the merged model (W + B A * alpha / r), "
        "its base read from model.kwargs.path (or the seeded init of a config); this builds "
        "the whole model in memory, in one process, unlike the other exports",
    )
    parser.add_argument(
        "--max-shard-size",
        default=MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"the largest weights file (default {MAX_SHARD_SIZE}, transformers' own): 5GB, "
        "500MB (powers of 1000), 2GiB (powers of 1024) or bytes; weights over it are split into "
        "model-0000k-of-0000n.safetensors with model.safetensors.index.json, as "
        "save_pretrained writes them",
    )
    parser.add_argument(
        "--out",
        help="output directory (default: <run>/export/<checkpoint>, <checkpoint>-hf for hf; "
        "for an s3:// run, ./export/<run name>/<checkpoint>)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Export the chosen (default: the best, where the run ranks them, else the latest)
    checkpoint; say which and why, then where it went."""
    # Heavy (the exporter loads torch.distributed's checkpoint stack): imported only here.
    from convoy.export import (
        TOKENIZER_NOTES,
        choose_checkpoint,
        export_checkpoint,
        export_hf,
        export_peft,
        parse_size,
        read_description,
        weight_files,
    )

    shard_bytes = parse_size(args.max_shard_size)
    if args.merge and args.format != "hf":
        raise ConvoyError(
            f"--merge: merges a model.lora run's adapters into an hf folder; got --format "
            f"{args.format}: use --format hf --merge, or --format peft for the adapters alone"
        )
    choice = choose_checkpoint(args.run, args.checkpoint)
    print(f"convoy: exporting {choice.name}, {choice.why}", flush=True)
    checkpoint = choice.name
    folder = checkpoint if args.format == "safetensors" else f"{checkpoint}-{args.format}"
    if args.out:
        out = Path(args.out)
    elif is_remote(args.run):  # next to where the command runs: exports are local files
        out = Path("export") / args.run.rstrip("/").rsplit("/", 1)[-1] / folder
    else:
        out = Path(args.run) / "export" / folder
    if args.format == "safetensors":
        export_checkpoint(args.run, out, checkpoint, shard_bytes)
        print(f"exported {checkpoint} to {out}{in_shards(weight_files(out))}")
        return 0
    if args.format == "peft":
        export_peft(args.run, out, checkpoint)
        print(f"exported {checkpoint}'s adapters to {out} for PEFT")
        return 0
    export_hf(args.run, out, checkpoint, shard_bytes, merge=args.merge)
    note = TOKENIZER_NOTES[read_description(out)["tokenizer"]]
    print(f"exported {checkpoint} to {out}{in_shards(weight_files(out))} for transformers; {note}")
    return 0


def in_shards(files: list[str]) -> str:
    """What the output line says of the weight files: nothing for one, their count for more."""
    return f" ({len(files)} shards and their index)" if len(files) > 1 else ""
