"""Fine-tuning data built offline: two chat-template families as Jinja strings (a Llama-3 style
and a ChatML / Qwen style, each also with ``{% generation %}`` tags as TRL's
``assistant_only_loss`` needs), tokenizer folders that carry them, and rows of each shape TRL
reads (``messages``, ``prompt`` + ``completion``, ``text``). Nothing is downloaded.

Callers skip without the ``hf`` extra; ``tokenizers`` and ``transformers`` are imported inside
the builders for that reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHATML_SPECIAL = ("<|im_start|>", "<|im_end|>")
PAD = "<|endoftext|>"

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama 3's layout: BOS, a header per turn, the content trimmed, ``<|eot_id|>``."""

LLAMA3_TAGGED = LLAMA3_TEMPLATE.replace(
    "{{- message['content'] | trim + '<|eot_id|>' }}",
    "{%- if message['role'] == 'assistant' %}{% generation %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}",
)
"""The same template with ``{% generation %}`` around each assistant turn (TRL's masks)."""

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen 2.5's layout: a default system turn, ``<|im_start|>role\\n ... <|im_end|>\\n``."""

CHATML_TAGGED = CHATML_TEMPLATE.replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}"
    "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}",
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {"template": LLAMA3_TEMPLATE, "tagged": LLAMA3_TAGGED, "end": "<|eot_id|>"},
    "chatml": {"template": CHATML_TEMPLATE, "tagged": CHATML_TAGGED, "end": "<|im_end|>"},
}

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]
"""Two assistant turns after a system and a user turn each."""


def sentences() -> list[str]:
    """The text the fixtures' BPE is trained on: every content above, and a little more."""
    extra = [
        "Write a haiku about the sea.",
        "Waves fold into foam; the gulls keep time.",
        "def add(a, b):\n    return a + b",
        "Count to three: one, two, three.",
    ]
    return [m["content"] for m in CONVERSATION] + extra


def chat_tokenizer(folder: Path, family: str, with_template: bool = True) -> Path:
    """A tokenizer folder of ``family`` (``llama3``: BOS added to plain text, EOS
    ``<|eot_id|>``; ``chatml``: no BOS, EOS ``<|im_end|>``) as ``save_pretrained`` writes it:
    a byte-level BPE of about 300 tokens trained on ``sentences()``, every chat marker a
    special token, and the family's template (``with_template``) beside it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [PAD, *LLAMA3_SPECIAL, *CHATML_SPECIAL]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special,
    )
    tokenizer.train_from_iterator(sentences() * 4, trainer=trainer)
    llama = family == "llama3"
    if llama:
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>" if llama else None,
        eos_token=FAMILIES[family]["end"],
        pad_token=PAD,
    )
    if with_template:
        fast.chat_template = FAMILIES[family]["template"]
    fast.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` one a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversations(count: int) -> list[dict[str, Any]]:
    """``count`` rows of ``messages``: the conversation cut after its first or second answer,
    with the question numbered so rows differ."""
    rows = []
    for i in range(count):
        turns = [dict(m) for m in CONVERSATION[: 3 if i % 2 else 5]]
        turns[1]["content"] = f"Question {i}: what is the capital of France?"
        rows.append({"messages": turns})
    return rows
