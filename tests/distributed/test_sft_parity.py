"""Fine-tuning on conversations (``data.name: sft``) under every data-parallel strategy, and
against TRL (gloo, fp32).

A Llama saved by transformers beside a chat tokenizer (Llama-3 template) trains on packed
conversations, the loss on the assistant turns only: ``single`` on the global batch ==
``ddp`` x 2 == ``fsdp2`` x 2 (1e-5), packing and the per-sample masks included. And the
loss Convoy computes on a set of rows (its model read from the folder, its samples, its
task) is the one TRL's ``SFTTrainer`` computes on the same rows with the same model (no
packing; TRL masks by the template's ``{% generation %}`` tags), over the same number of
trained tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.outputs import read_metrics
from convoy.testing import parity_overrides, run_on_gloo, train_on_rank
from sft_fixtures import FAMILIES, chat_tokenizer, conversations, write_jsonl

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed
STEPS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat model folder made offline: the tokenizer, and a tiny Llama of its vocabulary."""
    import transformers

    root = tmp_path_factory.mktemp("chat")
    model_dir = chat_tokenizer(root / "model", "llama3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(str(model_dir))
    data = root / "data"
    write_jsonl(data / "train.jsonl", conversations(16))
    write_jsonl(data / "val.jsonl", conversations(4))
    write_jsonl(data / "test.jsonl", conversations(4))
    return root


def sft_job(root: Path, tmp: Path, strategy: str, workers: int, *extra: str) -> Job:
    return load_job(
        None,
        [
            "task.name=language_modeling",
            "model.name=hf",
            f"model.kwargs={{path: {root / 'model'}}}",
            "data.name=sft",
            f"data.path={root / 'data'}",
            f"data.tokenizer_path={root / 'model'}",
            "data.seq_len=96",
            "data.batch_size=4",
            "data.eval_batch_size=4",
            "optim.lr=1e-3",
            *parity_overrides(tmp, strategy, workers, STEPS, 3, f"sft-{strategy}"),
            *extra,
        ],
    )


def step_losses(job: Job) -> list[float]:
    return [r["train/loss"] for r in read_metrics(job.run_dir) if r["kind"] == "step"]


@pytest.fixture(scope="module")
def single(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    job = sft_job(folder, tmp_path_factory.mktemp("single"), "single", 1)
    train(job, WorkerContext())
    losses = step_losses(job)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_packed_conversations_give_singles_losses(
    strategy: str, single: list[float], folder: Path, tmp_path: Path
) -> None:
    job = sft_job(folder, tmp_path, strategy, 2)
    run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(single, rel=1e-5)


def test_the_loss_on_a_set_of_rows_is_trls(folder: Path, tmp_path: Path) -> None:
    """All the training rows as one batch, unpacked: Convoy's loss (sum over trained
    tokens / their count) equals TRL's mean over its labels, to 1e-5, and the counts agree."""
    pytest.importorskip("trl")
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    from convoy.data.registry import load_splits
    from convoy.models.registry import build_initial
    from convoy.tasks.language_modeling import LanguageModeling

    job = sft_job(folder, tmp_path, "single", 1, "data.packing=false", "data.seq_len=256")
    splits = load_splits(job.data)
    items = [splits.train[i] for i in range(len(splits.train))]
    inputs = {k: torch.stack([x[k] for x, _ in items]) for k in ("input_ids", "position_ids")}
    targets = torch.stack([t for _, t in items])
    model = build_initial("hf", {"path": str(folder / "model")}, splits.shape, seed=0).eval()
    task = LanguageModeling()
    with torch.no_grad():
        _, loss_sum = task.forward_loss(model, inputs, targets)
    ours, our_count = float(loss_sum) / int(task.count(targets)), int(task.count(targets))

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder / "model"))
    tokenizer.chat_template = FAMILIES["llama3"]["tagged"]
    hub = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder / "model"), dtype=torch.float32
    )
    trainer = SFTTrainer(
        model=hub,
        args=SFTConfig(
            output_dir=str(tmp_path / "trl"),
            assistant_only_loss=True,
            packing=False,
            max_length=None,
            report_to="none",
            use_cpu=True,
        ),
        train_dataset=datasets.Dataset.from_list(conversations(16)),
        processing_class=tokenizer,
    )
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)
    with torch.no_grad():
        theirs = float(hub.eval()(**{k: batch[k] for k in ("input_ids", "labels")}).loss)
    their_count = int((batch["labels"][:, 1:] != -100).sum())
    assert our_count == their_count
    assert ours == pytest.approx(theirs, rel=1e-5)
