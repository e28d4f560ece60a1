"""Shared fixtures: global-state hygiene, one Ray per test session, small data on disk."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from processes import children_named, is_alive, pids_with_environ

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray 2.60 enables token auth by default; tests run an embedded Ray without it.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Inductor compiles in a pool of subprocesses (one per core), each importing torch: on 2 cores
# that costs each compiling process (a test, a gloo rank) more CPU than it saves.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Counts and tokenizers of streamed text go to a cache of this session only (workers inherit it).
TEST_CACHE = Path(tempfile.mkdtemp(prefix="convoy-test-cache-"))
os.environ["CONVOY_CACHE_DIR"] = str(TEST_CACHE)

# Each test's CPU, every process it starts counted, where a run asks (--suite-cpu-out; make
# test does): tests/cpu_accounting.py.
pytest_plugins = ["cpu_accounting"]

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist with ``--dist loadscope`` (``make test``), a module's tests stay on
    one worker, since they share its module fixtures (a cluster, a Ray head, a reference run),
    and the whole cluster tier is one scope, on one worker: its multi-node clusters and their
    node kills are timed against one another's CPU, not against a second cluster's."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # the dev extra's pytest-xdist

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return tier_scope(nodeid)

    # xdist hands out the scopes with the most tests first by default: here the cheapest
    # (a unit module of 100 one-millisecond tests) before the dearest (an e2e module of 3 Ray
    # runs), so a long e2e module could be the last one out, on one worker while the other
    # sits idle. The collection is ordered dearest tier first instead
    # (``pytest_collection_modifyitems``), so the cheap unit modules fill the end.
    config.option.loadscopereorder = False
    return TierScheduling(config, log)


def tier_scope(nodeid: str) -> str:
    """The scope a test is scheduled with: its module, or the whole cluster tier."""
    module = nodeid.split("::", 1)[0]
    return "tests/cluster" if module.startswith("tests/cluster/") else module


# The tiers from the dearest test to the cheapest (CPU seconds per test on 2 cores: a cluster
# or e2e test starts launchers and Ray, a distributed one forks gloo ranks, a unit test stays
# in its process).
TIER_ORDER = ("cluster", "e2e", "distributed", "gpu", "unit")


def tier_rank(nodeid: str) -> int:
    """Where a test's tier comes in ``TIER_ORDER`` (after them all when not in one)."""
    parts = nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Dearest tier first, each module's tests together and in their own order (a stable
    sort), so that workers given whole modules take the long ones first; within a tier, the
    modules that use the session's Ray before the others, so that it runs once per worker
    and is stopped once they are done (``pytest_runtest_teardown``), and of those, the ones
    marked ``ray_dashboard`` last."""
    SESSION_RAY.modules = {
        module_of(item): item.get_closest_marker(DASHBOARD_MARK) is not None
        for item in items
        if RAY_FIXTURE in item.fixturenames
    }

    def order(item: pytest.Item) -> tuple[int, bool, bool]:
        module = module_of(item)
        uses_ray = module in SESSION_RAY.modules
        # The modules that want the dashboard after those that do not: one restart a worker.
        return tier_rank(item.nodeid), not uses_ray, uses_ray and SESSION_RAY.modules[module]

    items.sort(key=order)


@pytest.fixture(scope="session", autouse=True)
def _remove_test_cache():
    yield
    shutil.rmtree(TEST_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Every test starts without a process group and with torch's default threads/seed."""
    threads = torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on loopback behind a proxy a test can cut; ``AWS_*`` points at it.

    Session-wide and started before Ray, so Ray's workers inherit the endpoint.
    """
    pytest.importorskip("moto")
    from s3server import start_s3

    server = start_s3("convoy")
    os.environ.update(server.env)
    yield server
    server.stop()


RAY_FIXTURE = "ray_session"
# A module whose tests need the session Ray's dashboard (the state API that Ray Train and
# Tune free a stopped trial's workers through) and Ray's metrics collection (Prometheus).
DASHBOARD_MARK = "ray_dashboard"


class SessionRay:
    """The embedded Ray of one pytest process, up only while its modules run: idle, it costs
    2 CPU-s a minute (GCS, raylet, the dashboard agent), 5 with the dashboard and metrics,
    which over the modules that follow the last Ray test was minutes of a 2-core suite.
    Stopped after the last test of a module that uses it when the next test's module does
    not; started again by the next test that needs it. Started without the dashboard and
    metrics, as ``convoy train`` starts its private Ray, unless the module is marked
    ``ray_dashboard`` (Tune's sweeps, the Prometheus metrics); with them, each Ray Train
    run also keeps Ray Train's metrics callbacks."""

    def __init__(self) -> None:
        # The modules whose tests use it (collection): whether each wants the dashboard.
        self.modules: dict[str, bool] = {}
        self.running: bool | None = None  # None: stopped; else whether with the dashboard
        self.started = False  # once, by the ray_session fixture
        self.module = ""  # the module of the test being set up

    def start(self, dashboard: bool) -> None:
        """Started as the launcher starts its private one (with the dashboard's state API and
        metrics where ``dashboard``); train workers take fractional CPUs."""
        import ray

        from convoy.config import RayLauncherConfig
        from convoy.launchers.ray import RayCluster, ensure_ray
        from convoy.launchers.ray_local import environment

        with environment(SESSION_RAY_ENV):
            ensure_ray(
                ray,
                RayCluster(address=None),
                resources={"convoy_trial_driver": 4},  # convoy tune's trial drivers
                settings=RayLauncherConfig(),
                state_api=dashboard,
                metrics=dashboard,
            )
        self.running, self.started = dashboard, True

    def start_for_module(self) -> None:
        self.start(self.modules.get(self.module, False))

    def lost(self) -> bool:
        """Whether the running Ray has lost its raylet (seen once on an overloaded machine:
        every later Ray test on that worker then failed at setup)."""
        return self.running is not None and not any(map(is_alive, children_named("raylet")))

    def stop(self) -> None:
        """``ray.shutdown()``, then SIGKILL to any worker of this Ray that outlived its raylet
        (a Ray Train controller was seen sleeping on for half an hour after its Ray ended)."""
        if self.running is not None:
            import ray

            raylets = children_named("raylet")
            ray.shutdown()
            for raylet in raylets:
                for pid in pids_with_environ(f"RAY_RAYLET_PID={raylet}"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self.running = None


# The session's Ray serves every run of its modules from one driver, so the processes that
# ran Ray Data's tasks (each has imported Ray Data's and Convoy's data modules, and torch for
# a streamed source or augmented images: 1-2.5 CPU-s) can serve the next run's. Ray keeps
# idle ones only while it holds fewer workers than this
# (its default: one per CPU, which a run's actors alone exceed on 2 cores); measured on
# test_encoded_images_decode_in_ray_data, two runs: 4 task processes -> 2, 77.8 -> 72.2 CPU-s.
SESSION_RAY_ENV = {"RAY_num_workers_soft_limit": "8"}

SESSION_RAY = SessionRay()


@pytest.fixture(scope="session")
def ray_session(s3):
    """One embedded Ray for the session's Ray tests (``SessionRay``); ``s3`` first, so that
    Ray's workers inherit its endpoint."""
    ray = pytest.importorskip("ray")
    SESSION_RAY.start_for_module()
    yield ray
    SESSION_RAY.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The session's Ray again, before the fixtures of a test that needs it, where it was
    stopped after an earlier module, runs without the dashboard this module wants, or lost
    its raylet."""
    SESSION_RAY.module = module_of(item)
    if not (SESSION_RAY.started and RAY_FIXTURE in item.fixturenames):
        return
    wanted = SESSION_RAY.modules.get(SESSION_RAY.module, False)
    if SESSION_RAY.running is not None and (SESSION_RAY.running != wanted or SESSION_RAY.lost()):
        SESSION_RAY.stop()
    if SESSION_RAY.running is None:
        SESSION_RAY.start(wanted)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test's module fixtures are torn down: stop the session's Ray when the next
    test (on this worker) is in a module that does not use it."""
    if nextitem is None or module_of(nextitem) not in SESSION_RAY.modules:
        SESSION_RAY.stop()


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A new folder with a short path (``/tmp/cvy<random>``), for ``RAY_TMPDIR``: Ray's Unix
    socket paths under it must fit in 107 bytes, which under pytest's ``tmp_path`` they
    may not."""
    folder = Path(tempfile.mkdtemp(prefix="cvy", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def write_cifar_batches(folder: Path, per_batch: int = 20, seed: int = 0) -> Path:
    """A tiny CIFAR-10 in the python-pickle format (real layout, random pixels)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, per_batch).tolist(),
            b"batch_label": name.encode(),
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    return folder


@pytest.fixture
def cifar_dir(tmp_path: Path) -> Path:
    return write_cifar_batches(tmp_path / "cifar-10-batches-py")


@pytest.fixture
def cifar_tarball(tmp_path: Path) -> Path:
    folder = write_cifar_batches(tmp_path / "src" / "cifar-10-batches-py")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    return archive


@pytest.fixture
def imagefolder(tmp_path: Path) -> Path:
    """train/val/<class>/*.png with two classes told apart by brightness."""
    from PIL import Image

    root = tmp_path / "images"
    for split, count in (("train", 6), ("val", 3)):
        for label, level in (("dark", 30), ("light", 220)):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.full((12, 10, 3), level + i, dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root
