"""A small chat model folder and its conversations, made offline, for ``recipes/chat_lora.yaml``.

    python examples/chat_model.py models/chat        # the model folder the recipe reads

writes a ``save_pretrained`` folder: a byte-level BPE of 512 tokens trained on the bundled
conversations (``examples/conversations.jsonl``), Llama 3's chat markers as special tokens and
its chat template, and a tiny Llama (hidden 64, 2 layers, about 0.2 M parameters) of that
vocabulary, seeded, given 300 steps of plain next-token training on the conversations'
sentences (no chat template), as a stand-in for a pretrained model: the LoRA fine-tune
then teaches it the chat form and the answers.

    python examples/chat_model.py --conversations examples/conversations.jsonl

rewrites the bundled conversations (arithmetic and unit questions in two turns, seeded).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
PAD = "<|pad|>"
TEMPLATE = (
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
CONVERSATIONS = Path(__file__).with_name("conversations.jsonl")
UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000)]


def conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """Two questions and their answers: a sum, then a unit conversion."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    n = rng.randint(2, 9)
    big, small, factor = rng.choice(UNITS)
    return {
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            {"role": "user", "content": f"How many {small} are in {n} {big}?"},
            {"role": "assistant", "content": f"{n} {big} are {n * factor} {small}."},
        ]
    }


def write_conversations(path: Path, count: int = 600, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(count)))


def texts(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [m["content"] for row in rows for m in row["messages"]]


def make_folder(
    folder: Path, conversations: Path = CONVERSATIONS, pretrain_steps: int = 300
) -> Path:
    """The tokenizer and the tiny Llama, saved into ``folder``; ``pretrain_steps`` of plain
    next-token training first (0: the seeded, untrained Llama, for checks of the folder's
    shape only)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[PAD, *SPECIAL],
    )
    tokenizer.train_from_iterator(texts(conversations), trainer=trainer)
    bos = SPECIAL[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token="<|eot_id|>", pad_token=PAD
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    pretrain(model, fast, conversations, pretrain_steps)
    model.save_pretrained(str(folder))
    return folder


def pretrain(model: object, tokenizer: object, conversations: Path, steps: int = 300) -> None:
    """A few hundred steps of next-token training on the conversations' sentences, every
    token (no chat template): the base then knows the words, as a pretrained model would,
    and the LoRA fine-tune teaches the chat form and the answers."""
    import torch

    ids = [tokenizer(text)["input_ids"] for text in texts(conversations)]  # type: ignore[operator]
    flat = torch.tensor([token for row in ids for token in row])
    rows = flat[: len(flat) // 65 * 65].view(-1, 65)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = rows[torch.randint(len(rows), (16,), generator=generator)]
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # type: ignore[operator]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?", help="where the model folder goes")
    parser.add_argument("--conversations", type=Path, help="rewrite the bundled conversations")
    args = parser.parse_args()
    if args.conversations:
        write_conversations(args.conversations)
        print(f"wrote {args.conversations}")
    if args.folder:
        print(f"wrote {make_folder(args.folder)}")


if __name__ == "__main__":
    main()
