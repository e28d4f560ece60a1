"""Model registry and built-in models: sizes, shapes, attention kernel, user factories."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import convoy.models.attention as attention_module
import convoy.models.vit as vit_module
from convoy.errors import ConfigError
from convoy.models import MODELS, build_model, count_parameters
from convoy.models.registry import check_model

DIGITS_SHAPE = {"num_classes": 10, "in_channels": 1, "image_size": 8}
CIFAR_SHAPE = {"num_classes": 10, "in_channels": 3, "image_size": 32}


@pytest.fixture(scope="module")
def course_vit() -> nn.Module:
    return build_model("vit_course", {}, CIFAR_SHAPE)  # ~1.5 s to initialise: build once


def test_course_vit_has_about_14_3m_parameters(course_vit: nn.Module) -> None:
    assert 14.1e6 < count_parameters(course_vit) < 14.4e6
    assert isinstance(course_vit.blocks, nn.ModuleList)
    assert len(course_vit.blocks) == 12


@torch.no_grad()
def test_course_vit_forward_shape(course_vit: nn.Module) -> None:
    assert course_vit(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_course_vit_has_torchvisions_init(course_vit: nn.Module) -> None:
    norms = [m for m in course_vit.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 12 + 1
    assert all(m.eps == 1e-6 for m in norms)
    assert (course_vit.head.weight == 0).all() and (course_vit.head.bias == 0).all()
    assert (course_vit.cls_token == 0).all()
    assert course_vit.pos_embed.std().item() == pytest.approx(0.02, rel=0.05)
    patch = course_vit.patch_embed
    assert patch.weight.std().item() == pytest.approx((1 / (3 * 4 * 4)) ** 0.5, rel=0.05)
    assert (patch.bias == 0).all()
    block = course_vit.blocks[0]
    bound = (6 / (384 + 3 * 384)) ** 0.5  # Xavier over MultiheadAttention's fused in_proj
    qkv = torch.cat([block.attn.q.weight, block.attn.k.weight, block.attn.v.weight])
    assert qkv.abs().max().item() <= bound
    assert qkv.std().item() == pytest.approx(bound / 3**0.5, rel=0.05)
    assert all((linear.bias == 0).all() for linear in block.attn.qkv_projections())
    assert (block.attn.proj.bias == 0).all()
    assert block.attn.proj.weight.abs().max().item() <= 1 / 384**0.5  # nn.Linear's default
    fc1, fc2 = block.mlp[0], block.mlp[2]
    assert fc1.weight.std().item() == pytest.approx((2 / (384 + 768)) ** 0.5, rel=0.05)
    assert 0 < fc2.bias.abs().max().item() < 1e-5  # normal(std=1e-6)


class TorchvisionEncoderBlock(nn.Module):
    """torchvision's ``EncoderBlock`` (dropout 0), to check ours computes the same function."""

    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Linear(mlp, hidden))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(inputs)
        x = self.self_attention(x, x, x, need_weights=False)[0] + inputs
        return x + self.mlp(self.ln_2(x))


@torch.no_grad()
def test_vit_block_computes_torchvisions_encoder_block() -> None:
    ours = vit_module.ViTBlock(hidden=32, heads=4, mlp=64, norm_eps=1e-6).eval()
    reference = TorchvisionEncoderBlock(hidden=32, heads=4, mlp=64).eval()
    for param in reference.parameters():  # nonzero biases too, so every weight is exercised
        param.normal_(std=0.2)
    attn = reference.self_attention
    renamed = {
        "norm1.weight": reference.ln_1.weight,
        "norm1.bias": reference.ln_1.bias,
        "attn.qkv.weight": attn.in_proj_weight,
        "attn.qkv.bias": attn.in_proj_bias,
        "attn.proj.weight": attn.out_proj.weight,
        "attn.proj.bias": attn.out_proj.bias,
        "norm2.weight": reference.ln_2.weight,
        "norm2.bias": reference.ln_2.bias,
        "mlp.0.weight": reference.mlp[0].weight,
        "mlp.0.bias": reference.mlp[0].bias,
        "mlp.2.weight": reference.mlp[2].weight,
        "mlp.2.bias": reference.mlp[2].bias,
    }
    ours.load_state_dict(renamed)
    tokens = torch.randn(3, 9, 32)
    torch.testing.assert_close(ours(tokens), reference(tokens), atol=1e-5, rtol=1e-5)


def test_vit_tiny_keeps_its_truncated_normal_init() -> None:
    model = build_model("vit_tiny", {}, DIGITS_SHAPE)
    assert all(m.eps == 1e-5 for m in model.modules() if isinstance(m, nn.LayerNorm))
    assert model.head.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert model.cls_token.abs().max().item() > 0


def test_unknown_vit_init_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="torchvision"):
        build_model("vit_tiny", {"init": "kaiming"}, DIGITS_SHAPE)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("vit_tiny", DIGITS_SHAPE),
        ("mlp", DIGITS_SHAPE),
        ("vit_tiny", {"num_classes": 7, "in_channels": 3, "image_size": 16}),
        ("mlp", {"num_classes": 3, "in_channels": 3, "image_size": 12}),
    ],
)
@torch.no_grad()
def test_forward_shape(name: str, shape: dict[str, int]) -> None:
    model = build_model(name, {}, shape)
    size = shape["image_size"]
    logits = model(torch.randn(5, shape["in_channels"], size, size))
    assert logits.shape == (5, shape["num_classes"])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_expose_blocks_as_module_list(name: str) -> None:
    # hf needs a model to build: transformers' ViT for the digits (its blocks: ViTLayer).
    kwargs = {"config": {"model_type": "vit", "patch_size": 2}} if name == "hf" else {}
    if name == "hf":
        pytest.importorskip("transformers")
    with torch.device("meta"):  # the large presets (gpt_1b) cost neither memory nor init time
        model = build_model(name, kwargs, DIGITS_SHAPE)
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) > 0


SERIES_SHAPE = {"num_classes": 4, "in_channels": 6, "seq_len": 100}  # UEA BasicMotions


def assert_every_parameter_gets_a_gradient(model: nn.Module, inputs: torch.Tensor) -> None:
    model(inputs).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("length", [100, 37])
@torch.no_grad()
def test_conv1d_classifies_series_of_any_length(length: int) -> None:
    model = build_model("conv1d", {}, SERIES_SHAPE)  # seq_len is not one of its arguments
    logits = model(torch.randn(5, 6, length))
    assert logits.shape == (5, 4)
    assert torch.isfinite(logits).all()


def test_conv1d_blocks_and_gradients() -> None:
    model = build_model("conv1d", {"depth": 4, "hidden": 32}, SERIES_SHAPE)
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) == 4
    assert_every_parameter_gets_a_gradient(model, torch.randn(3, 6, 50))


def test_conv1d_output_does_not_depend_on_the_batch() -> None:
    # No BatchNorm: a sample's logits (and so DDP's training) do not depend on what else is in
    # the batch, even in train mode.
    model = build_model("conv1d", {"dropout": 0.0}, SERIES_SHAPE).train()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    series = torch.randn(8, 6, 100)
    torch.testing.assert_close(model(series)[:3], model(series[:3]))


@pytest.mark.parametrize("outputs", [1, 3])
@torch.no_grad()
def test_tabular_mlp_maps_rows_to_outputs(outputs: int) -> None:
    model = build_model("tabular_mlp", {}, {"num_features": 10, "num_outputs": outputs})
    assert model(torch.randn(7, 10)).shape == (7, outputs)


def test_tabular_mlp_blocks_and_gradients() -> None:
    model = build_model("tabular_mlp", {"depth": 3, "dropout": 0.1}, {"num_features": 5})
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) == 3
    assert_every_parameter_gets_a_gradient(model, torch.randn(16, 5))


def test_attention_uses_scaled_dot_product_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    real = attention_module.F.scaled_dot_product_attention
    calls: list[tuple[int, ...]] = []

    def counting(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counting)
    model = build_model("vit_tiny", {"depth": 3}, DIGITS_SHAPE)
    model(torch.randn(2, 1, 8, 8))
    # batch, heads, tokens (16 patches + cls), head_dim (64 / 4)
    assert calls == [(2, 4, 17, 16)] * 3


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user package ``convoy_user_pkg.factories`` importable from ``tmp_path``."""
    package = tmp_path / "convoy_user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "factories.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def narrow(hidden: int = 4, num_classes: int = 10) -> nn.Module:
                model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Linear(hidden, num_classes))
                model.seen = {"hidden": hidden, "num_classes": num_classes}
                return model

            def anything(**kwargs) -> nn.Module:
                model = nn.Identity()
                model.seen = kwargs
                return model

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "convoy_user_pkg.factories"
    for name in [m for m in sys.modules if m.startswith("convoy_user_pkg")]:
        del sys.modules[name]


def test_user_factory_gets_only_the_data_kwargs_it_accepts(user_package: str) -> None:
    model = build_model(f"{user_package}:narrow", {"hidden": 6}, DIGITS_SHAPE)
    assert model.seen == {"hidden": 6, "num_classes": 10}
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_user_factory_with_var_kwargs_gets_every_data_kwarg(user_package: str) -> None:
    model = build_model(f"{user_package}:anything", {"image_size": 4}, DIGITS_SHAPE)
    assert model.seen == {**DIGITS_SHAPE, "image_size": 4}  # the recipe's kwargs win


@pytest.mark.parametrize(
    ("name", "kwargs", "field"),
    [
        ("vit_tiny", {"widht": 3}, "model.kwargs.widht"),
        ("mlp", {"heads": 2}, "model.kwargs.heads"),
        ("{pkg}:narrow", {"depth": 2}, "model.kwargs.depth"),
    ],
)
def test_bad_kwargs_name_the_key(
    user_package: str, name: str, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_model(name.format(pkg=user_package), kwargs)
    assert err.value.field == field
    assert field in str(err.value)


def test_build_with_rejected_kwargs_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        build_model("vit_tiny", {"hidden": 30, "heads": 4}, DIGITS_SHAPE)  # 30 % 4 != 0
    assert err.value.field.startswith("model.kwargs")


@pytest.mark.parametrize("suffix", [":missing", ":NOT_CALLABLE", "_nope:narrow"])
def test_bad_factory_path_is_a_config_error(user_package: str, suffix: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_model(user_package + suffix, {})
    assert err.value.field == "model.name"


def test_unknown_model_name_lists_the_registry() -> None:
    with pytest.raises(ConfigError, match="vit_course"):
        check_model("resnet50", {})
