"""Safetensors shards streamed from a DCP checkpoint: the size option, the cut, the files, the
index, and that no more than one shard's tensors are read at a time (in one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from convoy.cli import main
from convoy.commands.export import MAX_SHARD_SIZE
from convoy.errors import ConfigError
from convoy.export import shards
from convoy.export.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    WEIGHTS_FILE,
    TensorEntry,
    checkpoint_tensors,
    parse_size,
    plan_shards,
    read_weights,
    weight_files,
    write_shards,
)

ALLOWED = "a size above 0 like 5GB, 500MB, 2GiB, 64KiB or a number of bytes"


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DCP checkpoint laid out as Convoy's (``model`` and ``optim`` entries), of a small
    model whose head is tied to its embedding, and the model's state dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 32), nn.Linear(32, 16))
    model.append(nn.Linear(16, 64, bias=False))
    model[3].weight = model[0].weight  # tied: the state dict holds it under both names
    state = model.state_dict()
    path = tmp_path / "step_00000001"
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": state, "optim": {"step": torch.tensor(3.0)}}, checkpoint_id=path)
    return path, {key: tensor.clone() for key, tensor in state.items()}


@pytest.mark.parametrize(
    ("written", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("64kib", 64 * 2**10),
        ("1.5 GB", 1_500_000_000),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_sizes_in_decimal_and_binary_units_or_bytes(written: str | int, size: int) -> None:
    assert parse_size(written) == size


@pytest.mark.parametrize("written", ["5XB", "0", "-1", "GB", "", "0.1"])
def test_a_bad_size_names_the_option_the_value_and_what_is_allowed(written: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_size(written)
    assert str(refused.value) == f"--max-shard-size: got {written!r}; {ALLOWED}"


def test_the_commands_default_is_the_exporters_and_transformers() -> None:
    assert MAX_SHARD_SIZE == DEFAULT_MAX_SHARD_SIZE == "5GB"


def test_the_command_refuses_a_bad_size_in_one_line_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / "no-run"), "--max-shard-size", "5XB"]) == 2
    message = f"convoy: error: --max-shard-size: got '5XB'; {ALLOWED}"
    assert capsys.readouterr().err.splitlines() == [message]


def test_shards_are_cut_in_order_and_a_big_tensor_is_one_of_its_own() -> None:
    sizes = [40, 40, 30, 100, 10]
    entries = [TensorEntry(f"t{n}", f"t{n}", (size,), torch.uint8) for n, size in enumerate(sizes)]
    cut = plan_shards(entries, 80)
    assert [[entry.nbytes for entry in shard] for shard in cut] == [[40, 40], [30], [100], [10]]
    assert plan_shards([], 80) == [[]]  # always a file, if an empty one


def test_checkpoint_tensors_are_the_models_from_the_metadata(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, state = saved
    found = checkpoint_tensors(path)
    assert list(found) == list(state)  # no optimizer entry, in the model's order
    assert found["0.weight"] == TensorEntry("0.weight", "0.weight", (64, 16), torch.float32)
    assert found["0.weight"].nbytes == 64 * 16 * 4


def test_shards_hold_the_checkpoints_tensors_read_a_shard_at_a_time(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, state = saved
    read: list[list[TensorEntry]] = []
    read_tensors = shards.read_tensors

    def counted(at: Path, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
        read.append(entries)
        return read_tensors(at, entries)

    monkeypatch.setattr(shards, "read_tensors", counted)
    out = tmp_path / "out"
    out.mkdir()
    entries = list(checkpoint_tensors(path).values())
    files = write_shards(path, entries, out, 4096)  # the embedding and the head: 4,096 each
    assert files == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]
    assert all(sum(entry.nbytes for entry in shard) <= 4096 for shard in read)
    assert weight_files(out) == files

    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": sum(entry.nbytes for entry in entries)}
    assert set(index["weight_map"]) == set(state) and not (out / WEIGHTS_FILE).exists()
    loaded = read_weights(out)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_one_shard_is_model_safetensors_and_an_earlier_exports_shards_go(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, state = saved
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.json").write_text("{}")
    entries = list(checkpoint_tensors(path).values())
    write_shards(path, entries, out, 4096)
    assert write_shards(path, entries, out, 10**9) == [WEIGHTS_FILE]
    assert sorted(file.name for file in out.iterdir()) == ["model.json", WEIGHTS_FILE]
    loaded = read_weights(out)
    assert all(torch.equal(loaded[key], state[key]) for key in state)
