"""``model.name: hf``: bad input is one line before any worker, and what the strategies see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from convoy.config import load_job
from convoy.errors import ConfigError
from convoy.models.registry import build_model
from convoy.preflight import preflight
from hf_fixtures import GPT2_TINY, LLAMA_TINY, hf_overrides

transformers = pytest.importorskip("transformers")

TEXT = ["task.name=language_modeling", "data.name=text", "data.tokenizer=bytes", "data.seq_len=32"]


def checked(*overrides: str) -> None:
    # Two torchrun workers, as a user would start them: nothing is started here.
    base = ["scaling.launcher=torchrun", "scaling.num_workers=2", "strategy.name=ddp"]
    preflight(load_job(None, [*TEXT, *base, *overrides]))


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(*overrides)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    message = refusal("model.name=hf", f"model.kwargs.path={tmp_path}")
    assert message.startswith("model.kwargs.path: got ") and "has no config.json" in message
    assert "no such folder" in refusal("model.name=hf", f"model.kwargs.path={tmp_path}/nope")


def test_an_unknown_model_type_is_refused_with_the_close_ones(tmp_path: Path) -> None:
    message = refusal("model.name=hf", "model.kwargs.config.model_type=lama")
    assert message.startswith("model.kwargs.config.model_type: got 'lama'")
    assert "llama" in message
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    message = refusal("model.name=hf", f"model.kwargs.path={tmp_path}")
    assert message.startswith("model.kwargs.path: got 'not-a-model'")


def test_a_data_vocabulary_larger_than_the_models_is_refused(tmp_path: Path) -> None:
    small = {**LLAMA_TINY, "vocab_size": 100}
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**small)
    ).save_pretrained(tmp_path)
    message = refusal("model.name=hf", f"model.kwargs.path={tmp_path}")
    assert message.startswith("model.kwargs.path: ")
    assert "vocabulary has 100 tokens and the data's tokenizer 256" in message
    message = refusal(*hf_overrides(small))
    assert message.startswith("model.kwargs.config.vocab_size: got 100")


def test_tensor_parallel_on_a_model_without_a_plan_is_refused() -> None:
    message = refusal(*hf_overrides(GPT2_TINY), "strategy.name=fsdp2", "strategy.tp_size=2")
    assert message.startswith("strategy.tp_size: got 2")
    assert "no tensor-parallel plan for model_type 'gpt2'" in message
    checked(*hf_overrides(LLAMA_TINY), "strategy.name=fsdp2", "strategy.tp_size=2")


def test_sharding_a_model_whose_blocks_are_not_found_names_block_class() -> None:
    unmarked = ["model.name=hf_fixtures:llama_without_units", "model.kwargs={}"]
    checked(*unmarked)  # ddp: no units needed
    message = refusal(*unmarked, "strategy.name=fsdp2")
    assert message.startswith("model.kwargs.block_class: got None; fsdp2 works per block")
    assert "LlamaDecoderLayer" in message
    message = refusal(*unmarked, "strategy.activation_checkpointing=full")
    assert "activation checkpointing works per block" in message
    found = hf_overrides(LLAMA_TINY)
    checked(*found, "model.kwargs.block_class=LlamaDecoderLayer", "strategy.name=fsdp2")
    message = refusal(*found, "model.kwargs.block_class=LlamaLayer")
    assert message.startswith("model.kwargs.block_class: got 'LlamaLayer'; no layer")


def test_heads_follow_the_data() -> None:
    lm = build_model("hf", {"config": LLAMA_TINY}, {"vocab_size": 300})
    assert type(lm.model).__name__ == "LlamaForCausalLM" and lm.config.vocab_size == 300
    assert lm(torch.randint(0, 300, (2, 8))).shape == (2, 8, 300)
    vit = {
        "model_type": "vit",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "patch_size": 2,
    }
    images = build_model(
        "hf", {"config": vit}, {"num_classes": 10, "in_channels": 1, "image_size": 8}
    )
    assert type(images.model).__name__ == "ViTForImageClassification"
    assert images(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    bert = {
        "model_type": "bert",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    }
    regression = build_model("hf", {"config": bert}, {"vocab_size": 50, "num_outputs": 1})
    assert regression.config.problem_type == "regression"
    assert regression(torch.randint(0, 50, (4, 6))).shape == (4, 1)
    assert [type(b).__name__ for b in regression.blocks] == ["BertLayer"] * 2


def test_the_models_arguments_are_checked_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^model.kwargs: got .*; give one of path or config$"):
        build_model("hf", {}, {"vocab_size": 300})
    with pytest.raises(ConfigError, match=r"^model.kwargs.config: got .*; needs model_type"):
        build_model("hf", {"config": {"hidden_size": 32}}, {"vocab_size": 300})
    with pytest.raises(ConfigError, match=r"^model.kwargs.head: got 'seq2seq'; allowed: "):
        build_model("hf", {"config": LLAMA_TINY, "head": "seq2seq"}, {"vocab_size": 300})


def test_a_plan_with_styles_convoy_does_not_apply_is_refused() -> None:
    model = build_model("hf", {"config": LLAMA_TINY}, {"vocab_size": 300})
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise_rep"}
    with pytest.raises(ValueError, match="base_model_tp_plan uses colwise_rep; Convoy applies"):
        model.tensor_parallel_plan(2)
