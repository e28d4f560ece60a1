"""Training without a compile leaves torch._dynamo unimported (1.5-2 CPU-s a process), and
changes nothing else: the optimizer steps bit for bit as torch's, with its hooks and the LR
scheduler's bookkeeping, and the FLOP count is torch's."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from convoy.engine.schedule import EAGER_OPTIMIZERS, OPTIMIZERS


def _train(optimizer_class: type[torch.optim.Optimizer], name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    kwargs = {"momentum": 0.9} if name == "sgd" else {}
    optimizer = optimizer_class(model.parameters(), lr=0.1, weight_decay=0.01, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    hooked: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: hooked.append(1))
    for _ in range(4):
        model(torch.randn(5, 6)).square().mean().backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    optimizer.load_state_dict(optimizer.state_dict())
    assert len(hooked) == 4
    return [p.detach().clone() for p in model.parameters()]


def test_the_eager_optimizers_step_as_torch_s_with_hooks_and_no_warning() -> None:
    for name, torch_class in OPTIMIZERS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the scheduler's "step before optimizer.step()"
            ours = _train(EAGER_OPTIMIZERS[name], name)
        theirs = _train(torch_class, name)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), name
        assert isinstance(EAGER_OPTIMIZERS[name]([nn.Parameter(torch.ones(1))]), torch_class)


# In a fresh interpreter: this test process may have imported Dynamo already.
FRESH_PROCESS = """
import sys, torch
from torch import nn
from convoy.engine.flops import count_train_flops_per_sample
from convoy.engine.schedule import make_optimizer
from convoy.config import load_job
from convoy.tasks import build_task

model = nn.Linear(4, 3)
optimizer = make_optimizer(load_job().optim, [{"params": model.parameters()}], 0.1)
model(torch.randn(2, 4)).sum().backward()
optimizer.step()
optimizer.zero_grad()
task = build_task("classification", {})
batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
flops = count_train_flops_per_sample(lambda: nn.Linear(4, 3), task.forward, task.loss_sum, batch)
print("torch._dynamo" in sys.modules, flops)
import torch._dynamo  # a compile elsewhere in the process: the guards are torch's again
count_train_flops_per_sample(lambda: nn.Linear(4, 3), task.forward, task.loss_sum, batch)
from torch.utils.flop_counter import _FlopCounterMode
guarded = _FlopCounterMode.__dict__["__torch_dispatch__"].__wrapped__
print(getattr(guarded, "__dynamo_disable").__module__)
"""


def test_a_step_and_a_flop_count_import_no_dynamo_until_something_does() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.split("\n")[:2]
    # Linear 4 -> 3 per sample: forward 2*4*3, weight gradient 2*4*3 (no input gradient).
    assert first == f"False {2 * (2 * 4 * 3) / 1:.1f}"
    assert second.startswith("torch._dynamo")  # torch's real guard took over


# DDP over a one-process gloo group, in a fresh interpreter: its steps, a checkpoint's save and
# resume without Dynamo, then the same resume and a new DDP once Dynamo is loaded, with a
# setting only Dynamo's config holds.
DDP_FRESH_PROCESS = """
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from convoy.checkpoint import CheckpointManager, Position
from convoy.distributed import WorkerContext
from convoy.dynamo_guard import dynamo_stand_in
from convoy.storage import RunStorage
from convoy.engine.schedule import EAGER_OPTIMIZERS

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)

def steps(model):
    # torch's own optimizer class imports Dynamo; Convoy's does not
    optimizer = EAGER_OPTIMIZERS["sgd"](model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        torch.manual_seed(1)
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], optimizer

torch.manual_seed(0)
plain = nn.Linear(4, 3)
reference = nn.Linear(4, 3)
reference.load_state_dict(plain.state_dict())
with dynamo_stand_in():
    ddp = DistributedDataParallel(plain)
print("torch._dynamo" in sys.modules, "_dynamo" in vars(torch), ddp._use_python_reducer)
(got, optimizer), (expected, _) = steps(ddp), steps(reference)
print("torch._dynamo" in sys.modules, all(map(torch.equal, got, expected)))
# A checkpoint saved and resumed through Convoy's manager, as every run's are.
storage = RunStorage.at(sys.argv[2])
manager = CheckpointManager(storage, WorkerContext(), keep_latest=1)
manager.save(Position(3, 0, 3), ddp, optimizer, {})

def zeroed_then_resumed():
    with torch.no_grad():
        for parameter in ddp.parameters():
            parameter.zero_()
    CheckpointManager(storage, WorkerContext(), keep_latest=1).load_latest(ddp, optimizer)
    return all(map(torch.equal, [p.detach() for p in ddp.parameters()], got))

print("torch._dynamo" in sys.modules, zeroed_then_resumed(), "torch._dynamo" in sys.modules)
import torch._dynamo
# What torch's state dicts name with Dynamo loaded is what was saved without it.
print(zeroed_then_resumed())
# DDP compiled now: Dynamo runs the deferred forward guard's frame untraced, as torch's own.
traced = []
convert = torch._dynamo.convert_frame.ConvertFrameAssert.__call__
def noting(self, frame, *args, **kwargs):
    traced.append(frame.f_code.co_name)
    return convert(self, frame, *args, **kwargs)
torch._dynamo.convert_frame.ConvertFrameAssert.__call__ = noting
torch.compile(ddp, backend="eager")(torch.randn(5, 4)).sum().backward()
print(len(traced) > 0, not any("guarded_once" in name for name in traced))
torch._dynamo.config.optimize_ddp = "python_reducer"
with dynamo_stand_in():  # Dynamo loaded: torch's own reading of its setting
    print(DistributedDataParallel(nn.Linear(4, 3))._use_python_reducer)
dist.destroy_process_group()
"""


def test_ddp_steps_and_checkpoints_without_dynamo_and_reads_its_setting_once_loaded(
    tmp_path: Path,
) -> None:
    from convoy.distributed import free_port

    done = subprocess.run(
        [sys.executable, "-c", DDP_FRESH_PROCESS, str(free_port()), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # No Dynamo, no stand-in left on torch, torch's default mode; the steps equal a plain
    # model's bit for bit; a save and a resume restore them, still without Dynamo; the same
    # checkpoint resumes with Dynamo loaded; a compile of that DDP traces frames, but not
    # Convoy's deferred guard; then the user's setting reaches DDP.
    lines = done.stdout.split("\n")[:6]
    expected = ["False False False", "False True", "False True False", "True", "True True", "True"]
    assert lines == expected


# A language model's preflight in a fresh interpreter: the driver builds and runs the model on
# the meta device, through torch's meta kernels and Python references (``nn.init.normal_`` on
# meta is ``torch._refs.normal``), each guarded against Dynamo.
PREFLIGHT_FRESH_PROCESS = """
import sys
from convoy.config import load_job
from convoy.preflight import preflight

preflight(load_job(sys.argv[1], [f"run.storage_dir={sys.argv[2]}"]))
print("torch._dynamo" in sys.modules, "torch._refs" in sys.modules)
"""


def test_a_language_models_preflight_on_meta_imports_no_dynamo(tmp_path: Path) -> None:
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "lm_tiny.yaml"
    done = subprocess.run(
        [sys.executable, "-c", PREFLIGHT_FRESH_PROCESS, str(recipe), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "False True"
