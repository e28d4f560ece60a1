"""Where process groups, meshes and sharded parameters land: checked on CPU for what a GPU
machine gets wrong (torch's default mesh is the machine's accelerator, and every rank's
current CUDA device is cuda:0 unless it is set)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from convoy.config import load_job
from convoy.distributed import WorkerContext, join_process_group
from convoy.plan.model import fake_process_group


def test_a_cuda_rank_sets_its_device_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda *a, **kw: calls.append(("init", kw))
    )
    ctx = WorkerContext(rank=1, local_rank=1, world_size=2, device=torch.device("cuda", 1))
    assert join_process_group(ctx, timeout_s=5)
    assert [name for name, _ in calls] == ["set", "init"]
    assert calls[0][1] == torch.device("cuda", 1)
    assert calls[1][1]["device_id"] == torch.device("cuda", 1)

    calls.clear()
    assert join_process_group(WorkerContext(), timeout_s=5)  # CPU: no device to bind
    assert [name for name, _ in calls] == ["init"] and calls[0][1]["device_id"] is None


def _spy_on_meshes(monkeypatch: pytest.MonkeyPatch, target: str) -> list[Any]:
    """Replace ``target`` (a ``fully_shard``) with one that records each call's mesh."""
    from torch.distributed.fsdp import fully_shard

    meshes: list[Any] = []

    def spy(module: nn.Module, **kwargs: Any) -> Any:
        meshes.append(kwargs.get("mesh"))
        return fully_shard(module, **kwargs)

    monkeypatch.setattr(target, spy)
    return meshes


def test_fsdp2_shards_on_the_strategys_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a mesh, fully_shard takes the accelerator's: a run with scaling.use_gpu=false
    on a GPU machine had its model moved to cuda:0."""
    from convoy.strategies import build_strategy

    meshes = _spy_on_meshes(monkeypatch, "convoy.strategies.fsdp2.fully_shard")
    job = load_job(None, ["strategy.name=fsdp2"])
    strategy = build_strategy(job.strategy, torch.device("cpu"), torch.float32)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.blocks = nn.ModuleList([model[0], model[1]])  # type: ignore[assignment]
    with fake_process_group(2):
        wrapped = strategy.wrap(model)
        assert len(meshes) == 3  # each block, then the root
        for mesh in meshes:
            assert mesh is not None and mesh.device_type == "cpu" and mesh.size() == 2
        assert {p.device.type for p in wrapped.parameters()} == {"cpu"}


def test_the_planners_optimizer_step_shards_on_a_cpu_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's fake parameters are CPU ones; the default mesh of a GPU machine refused
    them (``Expects the parameter to already be moved to device cuda:0``)."""
    from convoy.plan.measure import measure_optimizer

    meshes = _spy_on_meshes(monkeypatch, "convoy.plan.measure.fully_shard")
    job = load_job(None, ["strategy.name=fsdp2"])
    cost = measure_optimizer(job, [(8, 4), (8,)], fsdp2_world_size=2)
    assert cost.state > 0
    assert len(meshes) == 1
    assert meshes[0] is not None and meshes[0].device_type == "cpu" and meshes[0].size() == 2


def test_peak_rss_is_this_image_not_the_one_exec_replaced() -> None:
    """A worker started by fork + exec from a large parent reports its own peak: ``ru_maxrss``
    keeps the parent's after exec, ``VmHWM`` does not."""
    import subprocess
    import sys

    parent = (
        "import subprocess, sys\n"
        "ballast = bytearray(400 << 20)\n"  # the parent's memory, touched
        "code = 'from convoy.distributed import peak_rss_bytes; print(peak_rss_bytes() >> 20)'\n"
        "out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,\n"
        "                     close_fds=False, preexec_fn=lambda: None).stdout\n"
        "print(out.strip())\n"
    )
    child_mib = int(
        subprocess.run(
            [sys.executable, "-c", parent], capture_output=True, text=True, check=True
        ).stdout
    )
    assert child_mib < 300, child_mib
