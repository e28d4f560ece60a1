"""RunStorage on local disk and on a real S3-compatible server (moto on loopback), and the
checkpoint manager's choice of what to resume from."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from convoy.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    Position,
    committed_checkpoints,
)
from convoy.distributed import WorkerContext
from convoy.storage import RunStorage, StorageError


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> RunStorage:
    if request.param == "local":
        return RunStorage.at(tmp_path / "run")
    request.getfixturevalue("s3")
    return RunStorage.at(f"s3://convoy/unit/{request.node.originalname}")


def test_files_and_directories(storage: RunStorage, tmp_path: Path) -> None:
    assert not storage.exists("a.txt")
    with pytest.raises(FileNotFoundError):
        storage.read_text("a.txt")
    storage.write_text("a.txt", "one")
    storage.write_text("a.txt", "two")  # replaced whole
    storage.append_text("log.jsonl", "1\n")
    storage.append_text("log.jsonl", "2\n")
    assert storage.read_text("a.txt") == "two"
    assert storage.read_text("log.jsonl") == "1\n2\n"

    source = tmp_path / "source"
    (source / "nested").mkdir(parents=True)
    (source / "x.bin").write_bytes(b"\x00\x01")
    (source / "nested" / "y.txt").write_text("y")
    storage.upload(source, "dirs/first")
    storage.upload(source, "dirs/second")
    assert storage.list_dirs("dirs") == ["first", "second"]
    assert storage.list_dirs("missing") == []
    storage.download("dirs/first", tmp_path / "back")
    assert (tmp_path / "back" / "x.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "back" / "nested" / "y.txt").read_text() == "y"

    storage.delete("dirs/first")
    storage.delete("dirs/never-was")  # nothing to do, no error
    assert storage.list_dirs("dirs") == ["second"]


def test_a_missing_bucket_is_a_clear_error(s3) -> None:  # type: ignore[no-untyped-def]
    storage = RunStorage.at("s3://no-such-bucket/runs/x")
    with pytest.raises(StorageError, match=r"cannot write s3://no-such-bucket/runs/x/config.yaml"):
        storage.write_text("config.yaml", "x")


def save_two(storage: RunStorage) -> tuple[nn.Linear, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(storage, WorkerContext(), keep_latest=2)
    weights = []
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights.append(model.weight.detach().clone())
        manager.save(Position(step, 0, step), model, optimizer, {})
    return model, optimizer, weights


def test_resume_prefers_the_checkpoint_the_launcher_names(storage: RunStorage) -> None:
    """Ray Train's get_checkpoint() may name an older committed checkpoint than the latest."""
    model, optimizer, weights = save_two(storage)
    assert committed_checkpoints(storage) == ["step_00000001", "step_00000002"]
    manager = CheckpointManager(storage, WorkerContext(), keep_latest=2)

    restored = manager.load_latest(model, optimizer, preferred="step_00000001")
    assert restored is not None and restored[0] == "step_00000001"
    assert torch.equal(model.weight, weights[0])

    restored = manager.load_latest(model, optimizer, preferred="step_00000009")  # not committed
    assert restored is not None and restored[0] == "step_00000002"
    assert torch.equal(model.weight, weights[1])


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path: Path) -> None:
    """A model that changed under the same run name (or a checkpoint from before a model's
    parameters were renamed) is named, not left to DCP's missing-key traceback; nothing is
    deleted."""
    storage = RunStorage.at(tmp_path / "run")
    save_two(storage)
    other = nn.Sequential(nn.Linear(4, 2))  # parameters 0.weight, 0.bias
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    manager = CheckpointManager(storage, WorkerContext(), keep_latest=2)
    with pytest.raises(CheckpointMismatchError) as info:
        manager.load_latest(other, optimizer)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "checkpoint step_00000002 does not fit this model: it lacks 0.bias and 1 more and "
        "holds bias and 1 more."
    )
    assert committed_checkpoints(storage) == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_one_process_saves_and_resumes_without_dcps_no_group_warning(
    tmp_path: Path, asynchronous: bool
) -> None:
    """A ``local`` run of one worker has no process group, and DCP warns on every save and
    load without one ("assuming the intent is to save in a single process"): that is the
    intent, so the run's output does not carry torch's warning."""
    storage = RunStorage.at(tmp_path / "run")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(storage, WorkerContext(), keep_latest=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(Position(1, 0, 1), model, optimizer, {}, asynchronous=asynchronous)
        manager.wait()
        assert manager.load_latest(model, optimizer) is not None
    assert committed_checkpoints(storage) == ["step_00000001"]
    assert [str(w.message) for w in caught if "torch.distributed" in str(w.message)] == []
