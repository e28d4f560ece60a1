"""One machine, many runs: each ``convoy`` command gets its own Ray, a Ray a user started is
joined and outlives the run, a dead one is noticed in seconds, and a busy machine neither
stops nor starves a run.

Every command runs as a user would start it (``python -m convoy`` / ``make run``, a separate
process with an embedded Ray of its own), with Ray's temp folder in a short private folder
(``RAY_TMPDIR``) so a head this test starts is visible to this test's runs only, and every
process it starts is ended by the folder's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from convoy.distributed import free_port
from processes import parent_of, pids_matching, stat_fields

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
REPO = Path(__file__).resolve().parents[2]
# digits_mlp on Ray, two workers: a run of a few seconds once its Ray is up.
SMALL_RUN = [
    str(REPO / "recipes" / "digits_mlp.yaml"),
    "-o", "scaling.launcher=ray",
    "-o", "scaling.num_workers=2",
    "-o", "run.epochs=1",
    "-o", "run.progress=plain",
    "-o", "checkpoint.every_epochs=null",
]  # fmt: skip
RUN_TIMEOUT_S = 600  # a guard against a hang, not a measurement


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[Path]:
    """A short private Ray temp folder (Ray puts Unix sockets under it); on exit, every
    process whose command line names it is ended, and it is removed."""
    folder = Path(tempfile.mkdtemp(prefix="cvy", dir="/tmp"))
    yield folder
    end_processes_naming(str(folder))
    shutil.rmtree(folder, ignore_errors=True)


def end_processes_naming(text: str) -> None:
    """SIGKILL every process whose command line contains ``text`` (this test's Ray only)."""
    for pid in pids_matching(lambda cmdline: text in cmdline):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            pid = parent_of(pid)
        except (OSError, ValueError):
            break
        chain.append(pid)
    return chain


def train_workers() -> dict[int, list[int]]:
    """Every live Ray Train worker on this machine, with its ancestors."""
    return {pid: ancestors(pid) for pid in pids_matching(lambda c: "ray::RayTrainWorker" in c)}


def ray_metrics_setting(pid: int) -> str | None:
    """The worker's ``RAY_enable_metrics_collection`` (None: Ray's default, on)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = entry.decode(errors="replace").partition("=")
        if key == "RAY_enable_metrics_collection":
            return value
    return None


def env_for(ray_tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("RAY_API_SERVER_ADDRESS", None)
    return {**env, "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1"}


def convoy(ray_tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "convoy", *args],
        env=env_for(ray_tmp),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(process: subprocess.Popen[str], head: Sequence[str] = ()) -> str:
    """What ``process`` printed, once it has ended well; ``head``: the lines already read from
    it through its text reader, whose buffer may hold more (``communicate`` reads past it)."""
    if head:
        assert process.stdout is not None
        output = "".join(head) + process.stdout.read()
        process.wait(timeout=RUN_TIMEOUT_S)
    else:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
    return output


def summary_of(output: str) -> dict[str, Any]:
    run_dir = next(
        line.split("run dir: ", 1)[1] for line in output.splitlines() if "run dir: " in line
    )
    return json.loads((Path(run_dir.strip()) / "summary.json").read_text())


def same_metrics(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-6)


def own_ray(output: str) -> str:
    """The address of the private Ray a run says it started."""
    line = next(x for x in output.splitlines() if "started a private Ray for this run" in x)
    return line.split("Ray at ", 1)[1].split(",", 1)[0]


def start_head(ray_tmp: Path) -> str:
    """``ray start --head`` as a user would (no dashboard, to keep it light): its address."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}"]
    options = ["--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"]
    done = subprocess.run(
        [*command, *options], env=env_for(ray_tmp), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return (ray_tmp / "ray" / "ray_current_cluster").read_text().strip()


@dataclass(frozen=True)
class JoinedRun:
    address: str  # of the head a user started
    output: str  # what the run on it printed
    head_outlived_the_run: bool


@pytest.fixture(scope="module")
def joined(ray_tmp: Path, tmp_path_factory: pytest.TempPathFactory) -> JoinedRun:
    """The small run alone on this machine, on a Ray a user started (``ray start --head``),
    which is then killed without ``ray stop`` (its address file stays). Its metrics are the
    ones every run that shares the machine must match."""
    address = start_head(ray_tmp)
    storage = tmp_path_factory.mktemp("alone")
    output = finish(convoy(ray_tmp, "train", *SMALL_RUN, "-o", f"run.storage_dir={storage}"))
    head = pids_matching(lambda c: "gcs_server" in c and str(ray_tmp) in c)
    end_processes_naming(str(ray_tmp / "ray" / "session_"))
    return JoinedRun(address, output, bool(head))


@pytest.fixture(scope="module")
def alone(joined: JoinedRun) -> dict[str, Any]:
    return summary_of(joined.output)


class WorkerSeen(NamedTuple):
    """A train worker as last seen: its nice value, its Ray metrics setting, and whether it
    leads a session of its own."""

    nice: int
    metrics: str | None
    own_session: bool


Seen = dict[str, dict[int, WorkerSeen]]


def worker_seen(pid: int) -> WorkerSeen:
    """The worker ``pid`` now, from one read of ``/proc/PID/stat`` (``OSError`` when gone)."""
    fields = stat_fields(pid)  # fields[3]: its session's id; fields[16]: its nice value
    return WorkerSeen(int(fields[16]), ray_metrics_setting(pid), int(fields[3]) == pid)


def watch_workers(
    processes: dict[str, subprocess.Popen[str]],
    then: Callable[[Seen], None] | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> Seen:
    """Until every process ends: the train workers that descend from each process, as each
    was last seen (``WorkerSeen``). No worker may descend from two of them. ``then`` is
    called with what has been seen after each look. A process still running after
    ``timeout`` seconds is killed and the test fails, naming it (``ray_tmp`` ends its Ray)."""
    seen: Seen = {name: {} for name in processes}
    strangers: list[tuple[int, list[int]]] = []
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes.values()):
        if time.monotonic() > deadline:
            running = [name for name, p in processes.items() if p.poll() is None]
            for name in running:
                processes[name].kill()
                processes[name].wait()
            pytest.fail(f"still running after {timeout:g} s, killed: {', '.join(running)}")
        for worker, chain in train_workers().items():
            owners = [name for name, p in processes.items() if p.pid in chain]
            if len(owners) > 1:
                strangers.append((worker, chain))
            for owner in owners:
                with contextlib.suppress(OSError):  # it ended meanwhile
                    seen[owner][worker] = worker_seen(worker)
        if then is not None:
            then(seen)
        time.sleep(0.2)
    assert not strangers, strangers
    return seen


@dataclass(frozen=True)
class FreshPair:
    outputs: dict[str, str]  # what each run printed, by name
    workers: Seen  # the train workers that descended from each run, and from the sweep
    sweep: str  # what the sweep the pair started during printed


RUNS = ("first", "second")


def start_sweep(ray_tmp: Path, storage: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """A one-trial ``convoy tune`` of the small run, once its private Ray is up and it goes on
    to start its trial: the process and the lines it printed so far. The trial trains on one worker (what is checked is whose
    Ray each worker is of, not the sweep's training)."""
    space = storage / "space.yaml"
    space.write_text("optim.lr: {grid: [3.0e-3]}\n")
    sweep = convoy(
        ray_tmp,
        "tune", *SMALL_RUN, "-o", "scaling.num_workers=1", "--space", str(space), "--name", "s",
        "--scheduler", "none", "--samples", "1", "--max-concurrent", "1",
        "-o", f"run.storage_dir={storage}",
    )  # fmt: skip
    assert sweep.stdout is not None
    head = [next(sweep.stdout)]
    while "convoy: sweep s:" not in head[-1]:
        head.append(next(sweep.stdout))
    return sweep, head


@pytest.fixture(scope="module")
def fresh_pair(
    ray_tmp: Path, joined: JoinedRun, tmp_path_factory: pytest.TempPathFactory
) -> FreshPair:
    """The same small run twice at once, as two users would start it, after the head the
    ``joined`` run used was killed (its address file left behind), and while a sweep on its
    own private Ray runs its trial: the runs the three tests below check, started once for
    the module."""
    storage = tmp_path_factory.mktemp("pair")
    sweep, head = start_sweep(ray_tmp, tmp_path_factory.mktemp("sweep"))
    runs = {
        name: convoy(ray_tmp, "train", *SMALL_RUN, "-o", f"run.storage_dir={storage / name}")
        for name in RUNS
    }
    workers = watch_workers({"sweep": sweep, **runs})
    outputs = {name: finish(process) for name, process in runs.items()}
    return FreshPair(outputs, workers, finish(sweep, head))


def test_a_user_started_ray_is_joined_and_outlives_the_run_then_its_death_is_noticed(
    ray_tmp: Path, joined: JoinedRun, fresh_pair: FreshPair, alone: dict[str, Any]
) -> None:
    """The run joins the head a user started, and the head outlives it; once the head is
    killed without ``ray stop``, each of the next runs (the two of ``fresh_pair``) says the
    address it found is not running, once, and trains on a Ray of its own."""
    assert f"joining the Ray started on this machine at {joined.address}" in joined.output
    assert "started a private Ray" not in joined.output
    assert joined.head_outlived_the_run
    # Killed without `ray stop`: Ray's address file still names the head.
    assert (ray_tmp / "ray" / "ray_current_cluster").read_text().strip() == joined.address
    for fresh in fresh_pair.outputs.values():
        stale = [line for line in fresh.splitlines() if joined.address in line]
        assert len(stale) == 1 and "is not running" in stale[0], fresh
        assert own_ray(fresh) != joined.address
        same_metrics(summary_of(fresh), alone)


def test_two_runs_started_together_each_train_on_their_own_ray(
    fresh_pair: FreshPair, alone: dict[str, Any]
) -> None:
    """Each on a Ray of its own, neither's workers the other's (``watch_workers`` fails on a
    worker of both), and each trains exactly what the run alone trained."""
    outputs, workers = fresh_pair.outputs, fresh_pair.workers
    # Each run's train workers are processes of its own Ray, which the run names.
    assert len(workers["first"]) == 2 and len(workers["second"]) == 2, workers
    assert own_ray(outputs["first"]) != own_ray(outputs["second"])
    assert not any("joining" in output for output in outputs.values())
    for output in outputs.values():
        same_metrics(summary_of(output), alone)


def test_runs_started_during_a_sweep_keep_to_their_own_ray(
    fresh_pair: FreshPair, alone: dict[str, Any]
) -> None:
    """The pair starts while a sweep's private Ray is up and its trial starts: neither run
    joins the sweep's Ray, and the sweep's trial ran on workers of its own."""
    assert fresh_pair.workers["sweep"], fresh_pair.workers
    sweeps_ray = own_ray(fresh_pair.sweep)
    for output in fresh_pair.outputs.values():
        assert own_ray(output) != sweeps_ray and sweeps_ray not in output
        same_metrics(summary_of(output), alone)


@pytest.fixture
def busy_cores() -> Iterator[Callable[[], None]]:
    """Processes spinning at the user's priority, one for each core but the one the run's own
    start-up keeps busy: every core of this machine busy until the test calls what this
    yields (or ends). (A spinner on every core made this the suite's dearest test, 585
    CPU-s, for the same checks.)"""
    count = max(1, len(os.sched_getaffinity(0)) - 1)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]

    def stop() -> None:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()

    yield stop
    stop()


def test_make_run_on_a_busy_machine_trains_at_the_users_priority_without_tracebacks(
    ray_tmp: Path, tmp_path: Path, busy_cores: Callable[[], None]
) -> None:
    recipe = yaml.safe_load((REPO / "recipes" / "default.yaml").read_text())
    # Start-up is what load broke (issue 16); a few steps of training under it then suffice.
    recipe["run"].update({"epochs": 1, "max_steps": 8, "storage_dir": str(tmp_path)})
    (tmp_path / "default.yaml").write_text(yaml.safe_dump(recipe))
    make = subprocess.Popen(
        ["make", "-s", "run", f"RECIPE={tmp_path / 'default.yaml'}"],
        cwd=REPO,
        env=env_for(ray_tmp),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    # The machine is busy through the start-up, which is what load broke; once both train
    # workers run (their priority and session are set as they start), the spinners stop.
    def started(seen: Seen) -> None:
        if len(seen["make"]) == 2:
            busy_cores()

    workers = watch_workers({"make": make}, then=started)["make"]
    output = finish(make)
    assert "epoch 1/1" in output and "run dir:" in output, output
    # Ray's default would be nice 15: a quarter of a fair share against the spinners.
    assert len(workers) == 2
    assert {seen.nice for seen in workers.values()} == {os.getpriority(os.PRIO_PROCESS, 0)}
    # Each in a session of its own, as torchrun's workers: Linux shares the CPU between
    # sessions first, and in the session of `make` they shared one share with the spinners.
    assert all(seen.own_session for seen in workers.values()), workers
    # A run without monitor.prometheus has no use for Ray's metrics collection.
    assert {seen.metrics for seen in workers.values()} == {"0"}
