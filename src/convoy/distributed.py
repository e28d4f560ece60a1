"""Rank-aware helpers: the worker context a launcher hands the engine, and small collectives.

``WorkerContext`` is the only thing the engine knows about where it runs. Each launcher builds
one from its own world (torchrun's env vars, Ray Train's context, or a world of one).
"""

from __future__ import annotations

import datetime
import os
import random
import resource
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WorkerContext:
    """Who this worker is and how to join its process group."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    init_method: str | None = None
    """How to create the process group if the launcher has not (``env://``, ``tcp://``)."""
    store_namespace: str | None = None
    """With ``env://``: a key prefix in the launcher's store, unique to this attempt."""
    checkpoint_reporter: Callable[[str, dict[str, Any]], None] | None = None
    """Hands each committed checkpoint (path relative to the run, metrics) to the launcher."""
    resume_from: str | None = None
    """The checkpoint the launcher says to resume from (relative to the run), if any."""
    cpus: float | None = None
    """CPUs the launcher gave this worker (Ray's allocation); None: its share of the node."""
    data: Any = None
    """Data the launcher prepared (a ``WorkerData`` of Ray Data shards); None: the engine
    builds DataLoaders itself."""
    stop_notices: Any = None
    """The launcher's own stop notices (a ``convoy.engine.stop.NoticeSource``: Ray Train's
    preemption notices), read at every step boundary; None: signals only."""
    sinks: tuple[Any, ...] = ()
    """The launcher's own event sinks (``convoy.engine.events.Sink``: Ray Train reports,
    Prometheus), on every rank; the launcher closes them after the entry returns."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Ray's worker processes take ports 10002-19999 by default; stay above them.
_LOWEST_CHOSEN_PORT = 20000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on loopback that is free now and outside the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` is an ephemeral one, which any outgoing
    connection may take between this call and the bind that uses it; then that bind fails
    and the other ranks wait for a store that never comes up. Outside the range only
    another explicit bind can race us.
    """
    low, high = ephemeral_port_range()
    candidates = [p for p in range(_LOWEST_CHOSEN_PORT, 65536) if not low <= p <= high]
    # Its own generator: the global one may be seeded for training and must not be moved.
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_process_group(ctx: WorkerContext, timeout_s: float) -> bool:
    """Create the process group unless one exists; True if this call created it."""
    if dist.is_initialized():
        return False
    cuda = ctx.device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # With several GPUs on a node each rank's current device must be its own before the group
    # exists: NCCL binds its communicator to it, and fully_shard's mesh and
    # all_gather_object stage on the current device (cuda:0 for every rank otherwise).
    device_id = ctx.device if cuda else None
    if cuda:
        torch.cuda.set_device(ctx.device)
    if ctx.store_namespace is not None:
        dist.init_process_group(
            backend,
            store=_namespaced_env_store(ctx, timeout),
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=timeout,
            device_id=device_id,
        )
        return True
    dist.init_process_group(
        backend,
        init_method=ctx.init_method or "env://",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return True


@contextmanager
def process_group(ctx: WorkerContext, timeout_s: float, needed: bool = True) -> Iterator[None]:
    """Join the process group for the body (when ``needed``); leave it only if we made it.

    Under Ray Train the group exists before the entry runs and stays Ray's to destroy.
    """
    created = join_process_group(ctx, timeout_s) if needed else False
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def _namespaced_env_store(ctx: WorkerContext, timeout: datetime.timedelta) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT, with keys under this attempt's namespace.

    torchrun's agent keeps one store across restarts; without a per-attempt prefix a restarted
    group can read the previous attempt's (dead) peer addresses and fail to connect.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        ctx.world_size,
        is_master=ctx.rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    return dist.PrefixStore(f"convoy/{ctx.store_namespace}", store)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over all ranks (identity without a process group)."""
    if not is_distributed():
        return values
    reduced = values.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced


def all_gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), in rank order: one small tensor
    all-gather, cheaper than pickling objects."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    if not is_distributed():
        return [local.tolist()]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated, or this process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` of ``/proc/self/status`` where there is
    one. Not ``ru_maxrss``: Linux carries that over ``exec`` from the image it replaced, so a
    worker forked from a large parent (a driver holding data, an S3 test server) would report
    the parent's size."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak memory the CUDA caching allocator reserved (None off the GPU: no allocator)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Flush and exit a worker process now, skipping interpreter teardown.

    After the process group is destroyed, torch's CPU worker threads can still race the
    interpreter's shutdown and abort ("terminate called without an active exception"), turning
    a finished worker into a failed one. Seen intermittently on CPU/gloo; the work and its
    outputs are complete by the time this is called.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# How gloo and NCCL word a collective that lost the rank at the other end.
LOST_PEER_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",
)


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective that lost another rank: this rank
    failed because that one did."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return any(
        isinstance(e, dist.DistNetworkError) or any(w in str(e) for w in LOST_PEER_WORDS)
        for e in chain
    )


def default_threads(local_world_size: int) -> int:
    """Split the CPUs this process may use (``usable_cpus``) between the workers on the node."""
    return max(1, int(usable_cpus()) // max(1, local_world_size))


def worker_threads(ctx: WorkerContext) -> int:
    """torch threads for a worker: the CPUs its launcher gave it (Ray's allocation), else its
    share of the CPUs this process may use."""
    if ctx.cpus is not None:
        return max(1, int(ctx.cpus))
    return default_threads(ctx.local_world_size)


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> float:
    """CPUs this process may use: its affinity mask, capped by the cgroup CPU quota.

    ``os.cpu_count()`` is the host's count; a container's or Kubernetes pod's CPU limit is a
    cgroup quota, and ``taskset`` / a scheduler's pinning is the affinity mask.
    """
    try:
        count: float = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1.0, min(count, quota)) if quota is not None else count


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota (quota / period) of this process's cgroup, v2 or v1; None when unlimited."""
    candidates = [root / "cpu.max", root / "cpu" / "cpu.cfs_quota_us", root / "cpu.cfs_quota_us"]
    for path in candidates:
        try:
            text = path.read_text().split()
        except OSError:
            continue
        if path.name == "cpu.max":  # v2: "<quota|max> <period>"
            if text[0] == "max":
                return None
            return int(text[0]) / int(text[1])
        quota = int(text[0])  # v1: -1 means unlimited
        if quota <= 0:
            return None
        return quota / int((path.parent / "cpu.cfs_period_us").read_text())
    return None
