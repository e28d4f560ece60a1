"""The course ViT's first steps: Convoy's ``vit_course`` against torchvision's VisionTransformer.

Question: does ``vit_course`` learn as fast early on as the course's model, torchvision's
``VisionTransformer(image_size=32, patch_size=4, num_layers=12, num_heads=8, hidden_dim=384,
mlp_dim=768)``? A user measured 27% against 75% validation accuracy after 20 steps when
``vit_course`` had the architecture but not torchvision's initialisation.

torchvision has no CPU wheel here, so ``reference_vit`` below re-creates its architecture and
initialisation in plain ``torch.nn`` (``nn.MultiheadAttention``, the same modules in the same
order). Before training, the script checks that ``vit_course`` is the same function (the
reference's weights, renamed, give the same logits) with the same initial distributions (the
standard deviation of every tensor).

Every model is trained through Convoy (local launcher, ``single`` strategy) on the same
CIFAR-shaped ``synthetic`` data, optimizer (AdamW, constant lr, no warmup), batch and seed.
The training split holds exactly ``steps_per_epoch`` batches and validation runs after every
epoch, so one run yields the validation accuracy after 5, 10, 15... steps.

    PYTHONPATH=src:. python benchmarks/vit_course_early.py [--epochs 8] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import tempfile
from collections import OrderedDict
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch import nn

import convoy
from convoy.models import build_model
from convoy.outputs import read_metrics

REFERENCE = "benchmarks.vit_course_early:reference_vit"
CIFAR_SHAPE = {"num_classes": 10, "in_channels": 3, "image_size": 32}
COURSE = {"image_size": 32, "patch_size": 4, "depth": 12, "heads": 8, "hidden": 384, "mlp": 768}

# label -> (model.name, model.kwargs)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "torchvision VisionTransformer (reference)": (REFERENCE, {}),
    "vit_course (torchvision init, eps 1e-6)": ("vit_course", {}),
    "vit_course, old init (trunc_normal 0.02, eps 1e-5)": (
        "vit_course",
        {"init": "trunc_normal", "norm_eps": 1e-5},
    ),
}


# ---------------------------------------------------------------------------------------------
# The reference: torchvision.models.vision_transformer, dropout 0, no pre-logits, no conv stem.


def layer_norm(hidden: int) -> nn.LayerNorm:
    return nn.LayerNorm(hidden, eps=1e-6)


class MLPBlock(nn.Sequential):
    """torchvision's ``MLPBlock``: ``ops.misc.MLP`` (Linear, GELU, Dropout, Linear, Dropout)."""

    def __init__(self, in_dim: int, mlp_dim: int) -> None:
        super().__init__(
            nn.Linear(in_dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(0.0),
            nn.Linear(mlp_dim, in_dim),
            nn.Dropout(0.0),
        )
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)


class EncoderBlock(nn.Module):
    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.ln_1 = layer_norm(hidden_dim)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = layer_norm(hidden_dim)
        self.mlp = MLPBlock(hidden_dim, mlp_dim)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(inputs)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + inputs
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(
        self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int, mlp_dim: int
    ) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(
            OrderedDict(
                (f"encoder_layer_{i}", EncoderBlock(num_heads, hidden_dim, mlp_dim))
                for i in range(num_layers)
            )
        )
        self.ln = layer_norm(hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        num_classes: int,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.conv_proj = nn.Conv2d(in_channels, hidden_dim, patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))

        fan_in = in_channels * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def reference_vit(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> nn.Module:
    """The course's model, torchvision's ViT (patch 4, 12 layers, 8 heads, 384, MLP 768)."""
    return VisionTransformer(
        image_size=image_size,
        patch_size=4,
        num_layers=12,
        num_heads=8,
        hidden_dim=384,
        mlp_dim=768,
        num_classes=num_classes,
        in_channels=in_channels,
    )


# ---------------------------------------------------------------------------------------------
# Same model? The reference's state dict renamed to vit_course's.

RENAMES = [
    (r"^conv_proj\.", "patch_embed."),
    (r"^class_token$", "cls_token"),
    (r"^encoder\.pos_embedding$", "pos_embed"),
    (r"^encoder\.ln\.", "norm."),
    (r"^heads\.head\.", "head."),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.", r"blocks.\1."),
    (r"\.ln_1\.", ".norm1."),
    (r"\.ln_2\.", ".norm2."),
    (r"\.self_attention\.in_proj_weight$", ".attn.qkv.weight"),
    (r"\.self_attention\.in_proj_bias$", ".attn.qkv.bias"),
    (r"\.self_attention\.out_proj\.", ".attn.proj."),
    (r"\.mlp\.3\.", ".mlp.2."),
]


def as_vit_course(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in state.items():
        for pattern, replacement in RENAMES:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor
    return renamed


@torch.no_grad()
def check_same_model() -> str:
    """Same initial distributions tensor by tensor, and the same function given the same
    weights; raises if not, returns a one-line report."""
    torch.manual_seed(0)
    reference = reference_vit().eval()
    ours = build_model("vit_course", {}, CIFAR_SHAPE).eval()
    initial = as_vit_course(reference.state_dict())
    mine = ours.state_dict()
    assert initial.keys() == mine.keys(), initial.keys() ^ mine.keys()
    worst = 0.0
    for name, tensor in initial.items():
        if tensor.numel() == 1 or tensor.std() == 0:  # constant: zeros, LayerNorm's ones
            assert torch.equal(tensor, mine[name]), name
        else:
            worst = max(worst, abs(mine[name].std().item() / tensor.std().item() - 1))
    assert worst < 0.25, f"initial standard deviations differ by up to {100 * worst:.0f}%"

    nn.init.normal_(reference.heads.head.weight, std=0.02)  # zero heads would hide everything
    ours.load_state_dict(as_vit_course(reference.state_dict()))
    images = torch.randn(8, 3, 32, 32)
    difference = (ours(images) - reference(images)).abs().max().item()
    assert difference < 1e-4, f"same weights, logits differ by {difference}"
    return (
        f"Checked first: the reference's weights, renamed, give vit_course the same logits "
        f"(max difference {difference:.1e}); at initialisation every constant tensor is equal "
        f"and every random one has the same standard deviation within {100 * worst:.1f}% "
        f"(sampling noise), over all {len(initial)} tensors."
    )


# ---------------------------------------------------------------------------------------------
# Training through Convoy.


def job_for(name: str, kwargs: dict[str, Any], storage: Path, run: str, args: Any) -> convoy.Job:
    overrides = [
        f"model.name={name}",
        *(f"model.kwargs.{key}={value}" for key, value in kwargs.items()),
        "data.name=synthetic",
        f"data.train_size={args.steps_per_epoch * args.batch_size}",
        f"data.batch_size={args.batch_size}",
        f"data.val_fraction={args.val_fraction}",
        "data.test_fraction=0.01",  # the final test pass is not the question: keep it short
        "optim.name=adamw",
        f"optim.lr={args.lr}",
        "optim.weight_decay=0.05",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "strategy.name=single",
        "scaling.launcher=local",
        "scaling.num_workers=1",
        f"run.epochs={args.epochs}",
        "run.eval_every_epochs=1",
        f"run.seed={args.seed}",
        "run.progress=off",
        f"run.storage_dir={storage}",
        f"run.name={run}",
    ]
    return convoy.load_job(None, overrides)


def val_curve(job: convoy.Job) -> tuple[dict[int, float], float]:
    """Validation accuracy by optimizer step, and the run's wall seconds."""
    result = convoy.train(job)
    epochs = [r for r in read_metrics(result.run_uri) if r.get("kind") == "epoch"]
    return {r["step"]: r["val/acc"] for r in epochs}, result.summary["wall_seconds"]


def render(curves: dict[str, dict[int, float]], points: list[int]) -> str:
    header = "| steps | " + " | ".join(curves) + " |"
    rows = [header, "|---:|" + "---:|" * len(curves)]
    for step in points:
        cells = [f"{100 * curve[step]:.1f}%" if step in curve else "-" for curve in curves.values()]
        rows.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(
    args: Any, check: str, curves: dict[str, dict[int, float]], seconds: dict[str, float]
) -> str:
    """The dated markdown file: setup, the equivalence check, the tables."""
    steps = args.epochs * args.steps_per_epoch
    train = args.steps_per_epoch * args.batch_size
    val = round(train * args.val_fraction)
    cpu = platform.processor() or platform.machine()
    every_step = sorted(next(iter(curves.values())))
    walls = ", ".join(f"{label}: {s:.0f} s" for label, s in seconds.items())
    return f"""# vit_course vs torchvision's VisionTransformer, first {steps} steps (CPU), {date.today()}

Produced by `python benchmarks/vit_course_early.py` (from the repository root).

- Machine: {os.cpu_count()} CPU cores ({cpu}), no GPU; Python {platform.python_version()},
  torch {torch.__version__}.
- Models: the course's shape (image 32, patch 4, 12 layers, 8 heads, hidden 384, MLP 768;
  14.3 M parameters), 10 classes. The reference is `reference_vit` in the script,
  torchvision's `VisionTransformer` re-created in plain `torch.nn` (`nn.MultiheadAttention`,
  torchvision's init; torchvision has no CPU wheel here), trained as
  `model.name={REFERENCE}`.
- Job, the same for all: `synthetic` data (CIFAR-shaped: a random template per class at
  amplitude 0.5 plus unit noise), {train} training images ({args.steps_per_epoch} steps per epoch), validation on
  {val} held-out images after every epoch; AdamW, lr {args.lr:g} constant (no warmup), weight
  decay 0.05, batch {args.batch_size}, fp32, seed {args.seed}; `scaling.launcher=local`,
  `strategy.name=single`. One run per model.

{check}

Validation accuracy after N optimizer steps:

{render(curves, args.points)}

Every evaluation:

{render(curves, every_step)}

Wall time per run: {walls}.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8, help="evaluations (one per epoch)")
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--points", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    check = check_same_model()
    print(check, flush=True)
    curves: dict[str, dict[int, float]] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="convoy-vit-early-") as tmp:
        for index, (label, (name, kwargs)) in enumerate(MODELS.items()):
            job = job_for(name, kwargs, Path(tmp), f"model-{index}", args)
            curves[label], seconds[label] = val_curve(job)
            print(f"{label}: {curves[label]} ({seconds[label]:.0f} s)", flush=True)
    out = args.out / f"vit_course_early_cpu_{date.today()}.md"
    out.write_text(report(args, check, curves, seconds))
    print(render(curves, args.points))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
