"""Bad input for tasks, user code and data: one line naming the field and value, raised by
the driver's preflight before any worker starts."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from convoy.config import load_job, micro_batch
from convoy.errors import ConfigError
from convoy.preflight import preflight

LM = ["task.name=language_modeling", "model.name=gpt_tiny", "data.name=text"]
BASE = ["strategy.name=single", "scaling.num_workers=1", "scaling.launcher=local"]

USER_MODULE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def raises(**kwargs):
    raise RuntimeError("the bucket is gone")


def not_pairs():
    return {"train": [1, 2, 3]}


def not_a_dataset():
    return {"train": 42}


def nan_targets():
    x = torch.randn(20, 3)
    y = torch.randn(20)
    y[7] = float("nan")
    return {"train": TensorDataset(x, y), "shape": {"num_features": 3}}


def broken_model(num_classes: int = 10):
    raise RuntimeError("weights file missing")


class NotATask:
    pass


def three_classes(bad_label: bool = False, with_shape: bool = True):
    x = torch.randn(30, 64)
    y = torch.arange(30) % 3
    if bad_label:
        y[11] = 4
    return {"train": TensorDataset(x, y), **({"shape": {"num_classes": 3}} if with_shape else {})}


def tokens(vocab: int = 50):
    ids = torch.randint(0, 60, (12, 16))
    return {"train": TensorDataset(ids, ids.roll(-1, 1)), "shape": {"vocab_size": vocab}}


def mlp_64(num_classes: int = 3):
    return nn.Sequential(nn.Linear(64, num_classes))


class ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        if x.sum().item() > 0:  # a value read in Python: the block's graph breaks here
            return self.linear(x)
        return x


class BreaksItsGraph(nn.Module):
    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([ReadsAValue()])
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def a_function_not_a_model(num_classes: int = 3):
    return lambda x: x


class ReadsValues(nn.Module):
    # Runs on CPU but not on the meta device: it reads a value.

    def __init__(self, num_classes: int = 3, fail: bool = False):
        super().__init__()
        self.linear = nn.Linear(64, num_classes)
        self.fail = fail

    def forward(self, x):
        if self.fail:
            raise RuntimeError("cannot run this batch")
        return self.linear(x) * float(x.abs().max().item() > 0)


def reads_values(num_classes: int = 3, fail: bool = False):
    return ReadsValues(num_classes, fail)


from convoy.tasks import Classification


class CountsAnInt(Classification):
    def count(self, targets):
        return len(targets)


class UnreducedLoss(Classification):
    def loss_sum(self, outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "preflight_user.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "preflight_user", raising=False)
    return "preflight_user"


def test_block_options_are_refused_before_any_worker(user_module: str) -> None:
    data = f"data.name={user_module}:three_classes"
    no_blocks = check([data, f"model.name={user_module}:mlp_64", *CHECKPOINTED])
    assert no_blocks.startswith("strategy.activation_checkpointing: got 'full'")
    assert "Sequential has no `blocks`" in no_blocks
    breaks = check([data, f"model.name={user_module}:BreaksItsGraph", "run.compile=true"])
    assert breaks.startswith("run.compile: got True; BreaksItsGraph's blocks do not compile")
    whole = [data, f"model.name={user_module}:BreaksItsGraph", "run.compile=model"]
    preflight(load_job(None, [*BASE, *whole]))  # a whole model may break its graph
    sharded = ["scaling.launcher=torchrun", "scaling.num_workers=2", "strategy.name=fsdp2"]
    refused = check([*whole, *sharded])
    assert refused.startswith("run.compile: got 'model'; fsdp2 hooks each block")
    assert "data-dependent" in breaks  # the compiler's own first line
    # The same model trains eagerly, and checkpoints its blocks.
    preflight(load_job(None, [*BASE, data, f"model.name={user_module}:BreaksItsGraph"]))
    preflight(
        load_job(None, [*BASE, data, f"model.name={user_module}:BreaksItsGraph", *CHECKPOINTED])
    )


CHECKPOINTED = ["strategy.activation_checkpointing=full"]


def check(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(load_job(None, BASE + overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("overrides", "starts", "contains"),
    [
        (["task.name=segmentation"], "task.name: got 'segmentation'", "'language_modeling'"),
        (["task.name=no_such.module:Task"], "task.name:", "could not import"),
        (["task.kwargs.ignore_index=-1", "task.kwargs.smoothing=0.1"], "task.kwargs:", "smoothing"),
        (
            ["checkpoint.best_metric=val/acc", *LM],
            "checkpoint.best_metric: got 'val/acc'",
            "val/bpb",
        ),
        (
            ["checkpoint.best_metric=val/acuracy"],
            "checkpoint.best_metric:",
            "did you mean 'val/acc'",
        ),
        # A model whose output does not fit the task: 10 logits for digits is right, 4 is not.
        (["model.name=mlp", "model.kwargs.num_classes=4"], "model.kwargs:", "data has 10 classes"),
        ([*LM, "model.kwargs.vocab_size=300"], "model.kwargs:", "smaller than the tokenizer's"),
        ([*LM, "data.seq_len=512"], "data.seq_len: got 512", "context_length 256"),
        (["task.name=regression", "data.name=digits"], "model.kwargs:", "num_outputs"),
        (
            [
                "data.loader=ray_data",
                "scaling.launcher=ray",
                "data.name=task_data_helpers:tuple_inputs",
            ],
            "data.loader:",
            "the inputs of 'task_data_helpers:tuple_inputs' are a list of 2",
        ),
    ],
)
def test_bad_task_model_and_data(overrides: list[str], starts: str, contains: str) -> None:
    message = check(overrides)
    assert message.startswith(starts), message
    assert contains in message, message


def test_user_code_failures_are_named(user_module: str) -> None:
    assert "the bucket is gone" in check([f"data.name={user_module}:raises"])
    message = check([f"data.name={user_module}:not_a_dataset"])
    assert message.startswith("data.name:") and "Dataset" in message
    message = check([f"data.name={user_module}:not_pairs"])
    assert message.startswith("data.name:") and "(inputs, targets) pairs" in message
    message = check([f"model.name={user_module}:broken_model"])
    assert message.startswith("model.name:") and "weights file missing" in message
    message = check([f"task.name={user_module}:NotATask"])
    assert message.startswith("task.name:") and "convoy.tasks.Task" in message


def test_data_that_does_not_fit_the_task_is_refused(user_module: str) -> None:
    data = f"data.name={user_module}:three_classes"
    model = f"model.name={user_module}:mlp_64"
    message = check([data, model, "data.kwargs.with_shape=false"])
    assert message.startswith("task.name: got 'classification'") and "num_classes" in message
    message = check([*LM[:1], "data.name=digits", "model.name=mlp"])
    assert message.startswith("task.name:") and "vocab_size" in message
    message = check([data, model, "data.kwargs.bad_label=true"])
    assert message.startswith("data.name:") and "is 4, outside 0..2" in message
    lm_data = [*LM[:2], f"data.name={user_module}:tokens"]
    message = check(lm_data)
    assert message.startswith("data.name:") and "vocab_size'] is 50" in message
    # top5 needs more than 5 classes; bpb needs the tokenizer's bytes per token.
    assert "allowed:" in check([data, model, "checkpoint.best_metric=val/top5"])
    message = check([*lm_data, "data.kwargs.vocab=64", "checkpoint.best_metric=val/bpb"])
    assert message.startswith("checkpoint.best_metric:") and "'val/ppl'" in message


def test_user_task_and_model_mistakes_are_named(user_module: str) -> None:
    data, model = f"data.name={user_module}:three_classes", f"model.name={user_module}:mlp_64"
    message = check([data, model, f"task.name={user_module}:CountsAnInt"])
    assert message.startswith("task.name:") and "count must return a 0-d tensor" in message
    message = check([data, model, f"task.name={user_module}:UnreducedLoss"])
    assert "loss_sum must return a 0-d tensor" in message and "shape (2,)" in message
    message = check([data, f"model.name={user_module}:a_function_not_a_model"])
    assert message.startswith("model.name:") and "not a torch.nn.Module" in message


def test_a_model_that_cannot_run_on_meta_is_checked_on_cpu(user_module: str) -> None:
    data, model = f"data.name={user_module}:three_classes", f"model.name={user_module}:reads_values"
    preflight(load_job(None, [*BASE, data, model]))  # fits: the CPU forward is checked
    message = check([data, model, "model.kwargs.num_classes=5"])
    assert message.startswith("model.kwargs:") and "data has 3 classes" in message
    message = check([data, model, "model.kwargs.fail=true"])
    assert message.startswith("model.name:") and "RuntimeError: cannot run this batch" in message


def test_regression_targets_with_nan_are_refused(user_module: str) -> None:
    message = check(
        ["task.name=regression", "model.name=tabular_mlp", f"data.name={user_module}:nan_targets"]
    )
    assert message.startswith("data.name:") and "index" in message and "nan" in message


def test_empty_corpus_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("   \n")
    message = check([*LM, f"data.path={tmp_path / 'empty.txt'}"])
    assert message.startswith("data.path:"), message


def test_best_mode_auto_follows_the_task() -> None:
    job = preflight(load_job(None, [*BASE, *LM, "checkpoint.best_metric=val/bpb"]))
    assert job.checkpoint.best_mode == "min"
    job = preflight(load_job(None, [*BASE, "checkpoint.best_metric=val/acc"]))
    assert job.checkpoint.best_mode == "max"
    job = preflight(
        load_job(None, [*BASE, "checkpoint.best_metric=val/acc", "checkpoint.best_mode=min"])
    )
    assert job.checkpoint.best_mode == "min"  # an explicit choice stays


def tensor_parallel(workers: int, tp: int) -> list[str]:
    return [
        "strategy.name=fsdp2",
        f"strategy.tp_size={tp}",
        "scaling.launcher=torchrun",
        f"scaling.num_workers={workers}",
        "data.batch_size=12",
    ]


def test_tensor_parallel_is_refused_before_any_worker(user_module: str) -> None:
    gpt = [
        "data.name=task_data_helpers:ragged_lm",
        "task.name=language_modeling",
        "model.name=gpt_tiny",
        "model.kwargs.context_length=64",
    ]
    heads = check([*gpt, *tensor_parallel(3, 3)])
    assert (
        heads == "strategy.tp_size: got 3; GPT: the model's 4 attention heads do not split over 3"
    )
    width = check(
        [
            *gpt,
            *tensor_parallel(3, 3),
            "model.kwargs.heads=3",
            "model.kwargs.hidden=96",
            "model.kwargs.mlp_ratio=1.0417",
        ]
    )
    assert width == "strategy.tp_size: got 3; GPT: the model's MLP width 100 does not split over 3"
    odd = check([*gpt, *tensor_parallel(2, 2), "data.kwargs.seq_len=33"])
    assert odd.startswith("strategy.tp_size: got 2; GPT's plan cuts each sequence")
    assert "the data's sequences have 33 tokens" in odd
    data = f"data.name={user_module}:three_classes"
    no_plan = check([data, f"model.name={user_module}:mlp_64", *tensor_parallel(2, 2)])
    assert no_plan.startswith("strategy.tp_size: got 2; Sequential states no tensor-parallel plan")
    assert "tensor_parallel_plan(self, tp_size)" in no_plan
    # The same jobs without tensor parallelism pass, and GPT with tp 2 on 32 tokens.
    preflight(load_job(None, [*BASE, *gpt]))
    preflight(load_job(None, [*BASE, *gpt, *tensor_parallel(2, 2)]))
    preflight(load_job(None, [*BASE, data, f"model.name={user_module}:mlp_64"]))


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (tensor_parallel(4, 3), "strategy.tp_size: got 3; must divide the world size 4"),
        (
            [*tensor_parallel(4, 2)[:-1], "data.batch_size=5"],
            "data.batch_size: got 5; the global batch must be divisible by scaling.num_workers / strategy.tp_size x optim.grad_accum_steps = 2 x 1",
        ),
        (
            [*tensor_parallel(4, 2), "strategy.name=hsdp", "strategy.shard_size=2"],
            "strategy.shard_size: got 2; hsdp with shard size 2 on 2 data-parallel ranks is one replica",
        ),
        (
            [*tensor_parallel(4, 2), "scaling.launcher=ray", "data.loader=ray_data"],
            "data.loader: got 'ray_data'; Ray Data streams each worker its own share",
        ),
    ],
)
def test_tensor_parallel_layouts_are_refused_by_the_config(
    overrides: list[str], start: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(None, BASE + overrides)
    assert str(info.value).startswith(start), str(info.value)


def test_a_tensor_parallel_group_shares_one_batch_split() -> None:
    """6 samples do not split over 4 ranks, but do over 2 data-parallel pairs (tp 2)."""
    job = load_job(None, [*BASE, *tensor_parallel(4, 2)[:-1], "data.batch_size=6"])
    assert micro_batch(job, 4) == 3
    with pytest.raises(
        ConfigError, match=r"strategy\.tp_size: got 2; must divide the world size 3"
    ):
        micro_batch(job, 3)
