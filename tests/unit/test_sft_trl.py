"""Convoy's ``sft`` samples against TRL's own preparation of the same rows (``SFTTrainer``'s
dataset: ``input_ids`` and ``labels``), for both template families and every row shape: the
same token ids, Convoy's targets the labels shifted by one (TRL's model shifts them), the same
trained-token counts. TRL masks assistant turns with ``{% generation %}`` tags
(``assistant_only_loss``), so it gets the tagged templates; Convoy gets the folder's own,
untagged one (its masks come from rendered prefixes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from convoy.config import DataConfig
from convoy.data.chat import ChatEncoder
from convoy.data.packing import IGNORE_INDEX
from convoy.data.sft import encode_split
from sft_fixtures import CONVERSATION, FAMILIES, chat_tokenizer, conversations

pytest.importorskip("transformers", reason="the 'hf' extra is not installed")
pytest.importorskip("datasets", reason="the 'hf' extra is not installed")
pytest.importorskip("trl", reason="TRL (the 'dev' extra) is not installed")

SHAPES: dict[str, list[dict[str, Any]]] = {
    "messages": conversations(6),
    "conversational prompt": [
        {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]},
        {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]},
    ],
    "string prompt": [
        {"prompt": "Count to three:", "completion": " one, two, three."},
        {"prompt": "Write a haiku about the sea.\n", "completion": "Waves fold into foam."},
    ],
    "text": [{"text": "Waves fold into foam; the gulls keep time."}, {"text": "def add(a, b):"}],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trl")
    return {family: chat_tokenizer(root / family, family) for family in FAMILIES}


def trl_samples(folder: Path, template: str, rows: list[dict[str, Any]], out: Path) -> list[Any]:
    """(input ids, labels) of each row as TRL's SFTTrainer prepares it, no packing; the
    assistant turns only where rows are conversations (TRL refuses the option elsewhere)."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.chat_template = template
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    args = SFTConfig(
        output_dir=str(out),
        assistant_only_loss=not isinstance(rows[0].get("text", rows[0].get("prompt")), str),
        packing=False,
        max_length=None,
        report_to="none",
        use_cpu=True,
    )
    trainer = SFTTrainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    return [(row["input_ids"], row["labels"]) for row in trainer.train_dataset]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_convoy_trains_the_tokens_trl_trains(
    family: str, shape: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    rows = SHAPES[shape]
    theirs = trl_samples(folders[family], FAMILIES[family]["tagged"], rows, tmp_path)
    encoder = ChatEncoder(folders[family], None, "assistant")
    cfg = DataConfig(name="sft", seq_len=1024)
    samples, notes, left_out = encode_split(
        encoder, [(f"row {i}", r) for i, r in enumerate(rows)], cfg
    )
    assert not left_out and notes.samples == len(rows)
    trained = 0
    for i, (ids, labels) in enumerate(theirs):
        start, end = samples.starts[i], samples.starts[i + 1]
        assert samples.ids[start:end].tolist() == ids
        # TRL's labels are the inputs where trained; its model predicts labels[j + 1] at j.
        assert samples.targets[start:end].tolist() == [*labels[1:], IGNORE_INDEX]
        trained += sum(label != IGNORE_INDEX for label in labels[1:])
    assert notes.trained == trained > 0
