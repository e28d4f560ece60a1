"""How a failed Ray Train run is told: a worker's ``ConvoyError`` unwrapped from Ray's
wrappers, a lost node named (once the GCS agrees it is dead), and which checkpoint resumes.
"""

from __future__ import annotations

import re
import time
from typing import Any

from convoy.checkpoint_listing import committed_checkpoints
from convoy.config import Job
from convoy.errors import ConvoyError, LaunchError


def fit(trainer: Any, job: Job) -> Any:
    """``trainer.fit()``, with a worker's ConvoyError or a lost node turned into one line."""
    from ray.train import TrainingFailedError

    try:
        return trainer.fit()
    except TrainingFailedError as exc:
        failures = getattr(exc, "worker_failures", {}) or {}
        for failure in failures.values():
            cause = _convoy_cause(failure)
            if cause is not None:
                raise cause from None
        lost = dead_nodes(lost_nodes(failures))
        if lost:
            raise LaunchError(
                f"Ray Train run failed: lost node {', '.join(lost)} (its workers stopped answering "
                f"and Ray marked the node dead); {checkpoint_hint(job)}; to continue on the "
                "nodes left instead, set scaling.max_failures and an elastic "
                "scaling.num_workers [MIN, MAX]"
            ) from None
        # The first line says what to do; Ray's report of each rank (tracebacks) follows.
        raise LaunchError(
            f"Ray Train run failed; {checkpoint_hint(job)}; to restart the workers after a "
            f"failure instead, set scaling.max_failures. Ray's report:\n{exc}"
        ) from None


def lost_nodes(failures: dict[int, BaseException]) -> list[str]:
    """The IPs of nodes whose workers stopped answering or died with their node.

    Ray reports a worker on a dead node as a failed health check ("actor is unavailable",
    with the worker's ``node_ip``) or as an actor that died with its node (``ip: ...``);
    an exception raised by the training code itself is not a lost node.
    """
    lost: list[str] = []
    for failure in failures.values():
        text = str(failure)
        unreachable = re.search(
            r"health check failed|actor .* unavailable|node (has )?died|raylet .*died", text, re.I
        )
        ip = re.search(r"node_ip='([^']+)'|\bip: (\S+)", text)
        # A surviving rank may report first: its collective lost the peer, which gloo words
        # as "Read error [ip]:port: Connection reset by peer" or "Connection closed by peer
        # [ip]:port". dead_nodes() then asks the GCS about that peer.
        peer = re.search(
            r"\[([\d.]+)\]:\d+: Connection (?:reset|closed) by peer"
            r"|Connection (?:reset|closed) by peer \[([\d.]+)\]:\d+",
            text,
        )
        for address in (
            (ip.group(1) or ip.group(2)) if unreachable and ip else None,
            (peer.group(1) or peer.group(2)) if peer else None,
        ):
            if address and address not in lost:
                lost.append(address)
    return lost


# Ray's GCS marks a node dead after missed health checks (5 x 3 s by default).
NODE_DEATH_WAIT_S = 20.0


def dead_nodes(candidates: list[str], timeout: float = NODE_DEATH_WAIT_S) -> list[str]:
    """Those of ``candidates`` (node IPs) that Ray marks dead within ``timeout``.

    A worker that stops answering may have died alone (a crash, an OOM kill) on a live node;
    only the GCS knows whether the node itself is gone.
    """
    import ray

    # The driver's own node answers this very question: it is not waited for (on a private
    # Ray, every worker's node is this one, and a crashed worker would cost the wait).
    own_node = ray.get_runtime_context().get_node_id()
    here = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == own_node}
    candidates = [ip for ip in candidates if ip not in here]
    deadline = time.monotonic() + timeout
    while candidates:
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        dead = [ip for ip in candidates if ip not in alive]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.5)
    return []


def checkpoint_hint(job: Job) -> str:
    """After a failed run: which committed checkpoint resumes it, if any."""
    try:
        saved = committed_checkpoints(job.run_uri)
    except Exception:  # unreadable storage: say what we can
        saved = []
    if saved:
        return f"the committed checkpoint {saved[-1]} resumes when you run {job.run.name!r} again"
    return "no checkpoint was committed (set checkpoint.every_steps to save during a run)"


def _convoy_cause(error: BaseException) -> ConvoyError | None:
    """A ConvoyError raised inside a worker, unwrapped from Ray's wrappers."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ConvoyError):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None
