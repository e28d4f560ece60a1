"""The driver's memory check (``convoy.preflight.check_memory``): ``run.skip_memory_check``
lets a job past, small jobs pass without being planned, and a rank's memory is its share of
this machine's (or of its container's limit), or its GPU's. The refusal itself:
``tests/e2e/test_memory_refusal.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import convoy.plan.fits
import convoy.preflight
from convoy.config import load_job
from convoy.data.registry import load_splits
from convoy.preflight import (
    RankMemory,
    cgroup_memory_limit,
    check_memory,
    host_memory,
    rank_memory,
    sample_batch,
)
from convoy.tasks import build_task

GIB = 2**30
# gpt_1b (3.78 GiB in fp32) on short sequences, 4 workers of one machine.
GPT_1B = [
    "model.name=gpt_1b",
    "data.seq_len=64",
    "data.batch_size=8",
    "scaling.num_workers=4",
    "scaling.launcher=torchrun",
]


@pytest.fixture
def host_of(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Make this machine's memory for a job ``size`` bytes (MemAvailable)."""

    def set_size(size: int) -> None:
        monkeypatch.setattr(convoy.preflight, "host_memory", lambda root: (size, "MemAvailable"))

    return set_size


@pytest.fixture
def not_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner must not run."""

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned")

    monkeypatch.setattr(convoy.plan.fits, "plan_world_size", fail)


def test_skip_memory_check_lets_it_past_unplanned(host_of, not_planned) -> None:  # type: ignore[no-untyped-def]
    host_of(24 * GIB)
    job = load_job("recipes/lm_tiny.yaml", [*GPT_1B, "run.skip_memory_check=true"])
    splits = load_splits(job.data)
    task = build_task(job.task.name, job.task.kwargs)
    check_memory(job, task, splits, sample_batch(job, splits))


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        ("recipes/digits_mlp.yaml", ["scaling.num_workers=2", "scaling.launcher=torchrun"]),
        ("recipes/lm_tiny.yaml", ["strategy.name=fsdp2"]),
        ("recipes/course_vit_synthetic.yaml", []),
    ],
)
def test_small_jobs_pass_without_being_planned(  # type: ignore[no-untyped-def]
    recipe: str, overrides: list[str], host_of, not_planned
) -> None:
    """A quick bound (48 bytes a parameter and 4x the activations a real forward of the
    sample saves, scaled to the micro-batch) lets them past: no planner, no Dynamo."""
    host_of(8 * GIB)
    job = load_job(recipe, overrides)
    splits = load_splits(job.data)
    task = build_task(job.task.name, job.task.kwargs)
    check_memory(job, task, splits, sample_batch(job, splits))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


MEMINFO = "MemTotal:       25165824 kB\nMemAvailable:   20971520 kB\n"  # 24 GiB, 20 GiB


def test_host_memory_is_mem_available_or_a_lower_cgroup_limit(tmp_path: Path) -> None:
    bare = _tree(tmp_path / "bare", {"proc/meminfo": MEMINFO})
    assert host_memory(bare) == (20 * GIB, "MemAvailable")
    # cgroup v2: the process's group says max, its parent 8 GiB
    v2 = _tree(
        tmp_path / "v2",
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/job/step\n",
            "sys/fs/cgroup/job/step/memory.max": "max\n",
            "sys/fs/cgroup/job/memory.max": f"{8 * GIB}\n",
        },
    )
    assert host_memory(v2) == (8 * GIB, "the container's memory limit")
    # cgroup v1: unlimited reads as a figure near 2**63
    v1 = _tree(
        tmp_path / "v1",
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{30 * GIB}\n",
        },
    )
    assert cgroup_memory_limit(v1) == 30 * GIB
    assert host_memory(v1) == (20 * GIB, "MemAvailable")  # the limit is higher


def test_a_cpu_rank_has_its_share_a_gpu_rank_its_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path, {"proc/meminfo": MEMINFO})
    four = load_job(
        "recipes/digits_mlp.yaml", ["scaling.launcher=torchrun", "scaling.num_workers=4"]
    )
    assert rank_memory(four, root) == RankMemory(20 * GIB, "MemAvailable", 4)
    gpu = load_job("recipes/digits_mlp.yaml", ["scaling.use_gpu=true"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_memory(gpu, root) is None  # the workers' GPUs are not this machine's to see

    class Device:
        name, total_memory = "H200", 140 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Device)
    assert rank_memory(gpu, root) == RankMemory(140 * GIB, "H200 memory")
    half = load_job(
        "recipes/digits_mlp.yaml", ["scaling.use_gpu=true", "scaling.gpus_per_worker=0.5"]
    )
    assert rank_memory(half, root) == RankMemory(70 * GIB, "H200 memory")
