"""The ray_data loader on sources read from disk with Hugging Face tools: ``sft``'s packed rows
(inputs a dict of ``input_ids`` and ``position_ids``) and ``hf_dataset``'s (next-token
sequences, classes), read through real Ray Data pipelines on the session's Ray, in this
process: the plan the driver makes, then each rank's train and eval batches as a worker reads
them, compared with the torch loader's samples of the same rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from convoy.config import Job, load_job
from convoy.data.base import Splits, collate
from convoy.data.registry import load_splits
from hf_fixtures import saved_labelled_dataset, saved_text_dataset
from sft_fixtures import chat_tokenizer, conversations, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
pytest.importorskip("transformers", reason="the 'hf' extra is not installed")
pytest.importorskip("datasets", reason="the 'hf' extra is not installed")

WORLD = 2
BATCH = 4


def ray_job(*overrides: str) -> Job:
    return load_job(
        None,
        [
            "scaling.launcher=ray",
            f"scaling.num_workers={WORLD}",
            "data.loader=ray_data",
            f"data.batch_size={BATCH}",
            "data.eval_batch_size=3",
            *overrides,
        ],
    )


def same(a: Any, b: Any) -> bool:
    """Whether two batches (tensors, or dicts of them) are equal."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def check_rank_batches(job: Job, splits: Splits) -> None:
    """Each rank's train micro-batches are the torch dataset's rows it was dealt (each row
    once over the ranks); each eval chunk is the split's rows in order, every row once."""
    from convoy.data.ray_data import build_ray_data
    from convoy.data.ray_data_worker import RayEvalBatches, RayTrainBatches

    plan = build_ray_data(job, WORLD)
    micro = BATCH // WORLD
    seen: list[int] = []
    for rank in range(WORLD):
        train = RayTrainBatches(plan.train, job, micro, WORLD, rank)
        train.seen = []
        train.start_epoch(0)
        batches = list(train)
        assert len(batches) == len(train) > 0
        for number, (inputs, targets) in enumerate(batches):
            rows = train.seen[number * micro : (number + 1) * micro]
            expected = collate([splits.train[i] for i in rows])
            assert same(inputs, expected[0]) and torch.equal(targets, expected[1])
        seen += train.seen
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(len(splits.train)))
    for split in ("val", "test"):
        dataset, read = getattr(splits, split), []
        for rank in range(WORLD):
            chunk = RayEvalBatches(
                plan.datasets[f"{split}_{rank}"], 3, plan.eval_rows[split], rank, plan.sample
            )
            chunk.seen = []
            batches = list(chunk)
            assert len(batches) == chunk.batches  # padded to the common count
            real = batches[: -(-chunk.num_real // 3)]
            expected = collate([dataset[i] for i in chunk.seen])
            assert same(joined([x for x, _ in real]), expected[0])
            assert torch.equal(torch.cat([y for _, y in real]), expected[1])
            read += chunk.seen
        assert read == list(range(len(dataset)))


def joined(batches: list[Any]) -> Any:
    """Batches (tensors, or dicts of them) concatenated along their rows."""
    if isinstance(batches[0], dict):
        return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    return torch.cat(batches)


def test_sft_packed_rows_go_through_ray_data_as_the_torch_loader_reads_them(
    tmp_path: Path, ray_session
) -> None:  # type: ignore[no-untyped-def]
    folder = chat_tokenizer(tmp_path / "tokenizer", "chatml")
    write_jsonl(tmp_path / "rows" / "train.jsonl", conversations(24))
    write_jsonl(tmp_path / "rows" / "validation.jsonl", conversations(5))
    write_jsonl(tmp_path / "rows" / "test.jsonl", conversations(3))
    job = ray_job(
        "data.name=sft",
        f"data.path={tmp_path / 'rows'}",
        f"data.tokenizer_path={folder}",
        "data.seq_len=160",
    )
    splits = load_splits(job.data)
    assert isinstance(splits.train[0][0], dict)
    check_rank_batches(job, splits)


@pytest.mark.parametrize("target", ["next_token", "class"])
def test_hf_dataset_rows_go_through_ray_data_as_the_torch_loader_reads_them(
    target: str, tmp_path: Path, ray_session
) -> None:  # type: ignore[no-untyped-def]
    if target == "next_token":
        saved = saved_text_dataset(tmp_path / "text")
        overrides = ["data.tokenizer=bytes", "data.seq_len=256", "data.train_size=24"]
    else:
        saved = saved_labelled_dataset(tmp_path / "rows")
        overrides = ["data.feature_columns=[a, b, pair]"]
    job = ray_job("data.name=hf_dataset", f"data.path={saved}", f"data.target={target}", *overrides)
    check_rank_batches(job, load_splits(job.data))
