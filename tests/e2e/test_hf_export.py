"""``convoy export --format hf``: a run's checkpoint as a folder ``transformers`` loads.

A Llama-shaped model (grouped-query attention) trained with FSDP2 on two torchrun workers,
and a GPT-2-shaped one (its LM head tied to the token embedding) trained in one process,
are exported with the command a user types (``convoy export``'s arguments to ``cli.main``, in
the test's process: the folder is what is tested, not a process's start);
``AutoModelForCausalLM`` and ``AutoTokenizer`` then load the folder, and its logits are the
checkpoint's own. Each is exported again split over a small ``--max-shard-size`` (three
shards or more and their index), which ``from_pretrained`` loads to the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import convoy
from convoy.cli import main
from convoy.config import load_job
from convoy.data.tokenizer import BPETokenizer
from convoy.errors import ConvoyError
from convoy.export import INDEX_FILE, MODEL_FILE, WEIGHTS_FILE, evaluate_exported, weight_files
from convoy.export.consolidate import consolidated_model, read_checkpoint
from convoy.export.to_hf import hub_entries, hub_weights
from convoy.models.registry import build_model
from convoy.outputs import TOKENIZER_FILE

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers", reason="the 'hf' extra is not installed")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TEXT = "def main():\n    return {'größe': 3}  # naïve ✓\n"
"""Source-like text with multi-byte characters, to tokenize and run through both models."""

TINY_LLAMA = [
    "model.kwargs.config.hidden_size=32",
    "model.kwargs.config.intermediate_size=64",
    "model.kwargs.config.num_hidden_layers=2",
    "model.kwargs.config.num_attention_heads=4",
    "model.kwargs.config.num_key_value_heads=2",
    "model.kwargs.config.max_position_embeddings=64",
    "data.vocab_size=512",
]
FEW_SHORT_STEPS = [
    "data.seq_len=32",
    "data.batch_size=8",
    "data.eval_batch_size=64",
    "run.epochs=1",
    "run.max_steps=3",
    "run.progress=off",
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """40k characters of CPython's help topics: the text recipe's own corpus, cut short so
    that the tokenizer trains and the splits evaluate in a blink."""
    text = "\n\n".join(topics[name] for name in sorted(topics))[:40_000]
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def convoy_cli(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``convoy ARGS`` through the CLI's ``main`` in this process: its exit code, and what it
    (and any worker it started) printed to stdout and stderr."""
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def export_hf(capfd: pytest.CaptureFixture[str], run: Path, out: Path, *more: str) -> str:
    """``convoy export RUN --format hf --out OUT [MORE]``; its output line."""
    code, stdout, stderr = convoy_cli(
        capfd, "export", str(run), "--format", "hf", "--out", str(out), *more
    )
    assert code == 0, stderr
    return stdout


def export_sharded(
    capfd: pytest.CaptureFixture[str], run: Path, out: Path, max_shard_size: str
) -> tuple[Any, dict[str, str]]:
    """The run exported again in shards of at most ``max_shard_size`` beside ``out`` (three or
    more, as the tests size them): the folder as ``AutoModelForCausalLM`` loads it, and its
    index's weight map."""
    sharded = out.with_name(f"{out.name}-sharded")
    line = export_hf(capfd, run, sharded, "--max-shard-size", max_shard_size)
    files = weight_files(sharded)
    assert len(files) >= 3 and f"({len(files)} shards and their index)" in line
    assert not (sharded / WEIGHTS_FILE).exists()
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (sharded / name).read_text() == (out / name).read_text()
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    return transformers.AutoModelForCausalLM.from_pretrained(sharded).eval(), weight_map


def load_and_run(
    run: Path, folder: Path, ids: torch.Tensor
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The exported folder as ``AutoModelForCausalLM`` loads it, its logits, and the logits
    of Convoy's model read from the run's (sharded) checkpoint, on the same input ids."""
    exported = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = consolidated_model(read_checkpoint(run))
    with torch.no_grad():
        return exported, exported(input_ids=ids).logits, ours(ids)


def test_llama_trained_with_fsdp2_on_torchrun_exports_for_transformers(
    tmp_path: Path, corpus: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        *TINY_LLAMA,
        *FEW_SHORT_STEPS,
        f"data.path={corpus}",
        "scaling.launcher=torchrun",
        f"run.storage_dir={tmp_path}",
    ]
    code, _, err = convoy_cli(
        capfd, "train", str(RECIPES / "lm_llama_hf.yaml"), "-o", "run.name=llama",
        *(arg for override in overrides for arg in ("-o", override)),
    )  # fmt: skip
    assert code == 0, err[-3000:]
    run = tmp_path / "llama"
    (checkpoint,) = (run / "checkpoints").iterdir()
    assert len(list(checkpoint.glob("*.distcp"))) == 2  # sharded by two ranks

    out = tmp_path / "hf"
    assert "tokenizer: the run's BPE" in export_hf(capfd, run, out)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (out / "generation_config.json").is_file()

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    trained_on = BPETokenizer.from_json((run / TOKENIZER_FILE).read_text()).encode([TEXT])
    assert ids[0].tolist() == trained_on.tolist()  # the ids the model learned
    model, exported, ours = load_and_run(run, out, ids)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert exported.shape == (1, ids.shape[1], 512)
    assert (exported - ours).abs().max().item() <= 1e-6
    split, weight_map = export_sharded(capfd, run, out, "70KB")
    assert weight_map.keys() == load_file(out / WEIGHTS_FILE).keys()
    with torch.no_grad():
        assert torch.equal(split(input_ids=ids).logits, exported)

    # convoy evaluate takes the folder too: its test metrics are the ones recorded.
    recorded = json.loads((out / MODEL_FILE).read_text())["metrics"]
    measured = evaluate_exported(out)
    assert measured["test/loss"] == pytest.approx(recorded["test/loss"], rel=1e-5)


def test_gpt2_tied_weights_and_byte_tokenizer_round_trip(
    tmp_path: Path, corpus: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = load_job(
        RECIPES / "lm_llama_hf.yaml",
        [
            *FEW_SHORT_STEPS,
            "model.kwargs.config={model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 2, "
            "n_positions: 64}",
            "data.tokenizer=bytes",
            f"data.path={corpus}",
            "strategy.name=single",
            "scaling.launcher=local",
            "scaling.num_workers=1",
            "run.name=gpt2",
            f"run.storage_dir={tmp_path}",
        ],
    )
    convoy.train(job)
    out = tmp_path / "hf"
    assert "tokenizer: UTF-8 bytes" in export_hf(capfd, job.run_dir, out)
    keys = load_file(out / WEIGHTS_FILE)
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # written once

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(TEXT.encode())
    assert tokenizer.decode(ids[0]) == TEXT
    model, exported, ours = load_and_run(job.run_dir, out, ids)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again on loading
    assert (exported - ours).abs().max().item() <= 1e-6
    split, weight_map = export_sharded(capfd, job.run_dir, out, "40KB")
    assert weight_map.keys() == keys.keys()  # the tied head written once in shards too
    assert split.lm_head.weight is split.transformer.wte.weight
    with torch.no_grad():
        assert torch.equal(split(input_ids=ids).logits, exported)


def test_hf_export_of_another_model_says_to_use_safetensors(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = load_job(
        RECIPES / "digits_mlp.yaml",
        [
            "strategy.name=single",
            "scaling.launcher=local",
            "run.max_steps=1",
            "run.name=mlp",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
        ],
    )
    convoy.train(job)
    code, _, err = convoy_cli(capfd, "export", str(job.run_dir), "--format", "hf")
    assert code == 2
    assert err.splitlines() == [
        "convoy: error: --format: got 'hf'; this run's model is 'mlp' (model.name), not a "
        "transformers model (model.name: hf): use --format safetensors"
    ]
    assert not (job.run_dir / "export").exists()


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_in_one_line(tmp_path: Path) -> None:
    """The weights ``save_pretrained`` would write are found from the model built on the meta
    device (a tied head once); a checkpoint holding one in another shape is refused."""
    config = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8)
    with torch.device("meta"):
        inner = transformers.GPT2LMHeadModel(config)
    weights = hub_weights(inner)
    assert weights is not None and "lm_head.weight" not in weights
    state = {f"model.{name}": torch.zeros(weight.shape) for name, weight in weights.items()}
    state["model.transformer.wte.weight"] = torch.zeros(17, 8)
    path = tmp_path / "step_00000001"
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": state}, checkpoint_id=path, no_dist=True)
    with pytest.raises(ConvoyError) as refused:
        hub_entries(path, weights)
    assert str(refused.value) == (
        "checkpoint step_00000001 has a tensor of shape [17, 8] for the job's model's "
        "model.transformer.wte.weight (shape [16, 8]): it was written by another model"
    )


def saved_run(run: Path, overrides: list[str], data_shape: dict[str, int]) -> torch.nn.Module:
    """A run folder with one committed checkpoint of the job's untrained model, laid out as
    training writes it (the model's DCP entries and ``meta.json``); the model."""
    job = load_job(RECIPES / "lm_llama_hf.yaml", overrides)
    model = build_model(job.model.name, job.model.kwargs, data_shape)
    path = run / "checkpoints" / "step_00000001"
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)
    meta = {"step": 1, "data_shape": data_shape, "job": job.model_dump(mode="json")}
    (path / "meta.json").write_text(json.dumps(meta))
    return model.eval()


def test_a_model_whose_weights_transformers_converts_is_written_whole_in_shards(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Mixtral's experts are fused when ``transformers`` loads them and split again when it
    saves, all at once: such a model is consolidated and ``save_pretrained`` writes it, in
    shards of the size asked for, which ``from_pretrained`` loads to the same logits."""
    config = (
        "{model_type: mixtral, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 2, "
        "num_attention_heads: 2, num_key_value_heads: 1, num_local_experts: 2, "
        "max_position_embeddings: 32}"
    )
    run, out = tmp_path / "run", tmp_path / "hf"
    ours = saved_run(run, [f"model.kwargs.config={config}"], {"vocab_size": 64, "seq_len": 16})
    assert "shards and their index" in export_hf(capfd, run, out, "--max-shard-size", "8KB")
    assert len(weight_files(out)) >= 3
    assert any(
        ".experts.0." in name for name in json.loads((out / INDEX_FILE).read_text())["weight_map"]
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ours(ids))
