"""Ray node preemption: Ray Train's notice turned into the loop's stop request, and what a
worker does once it has saved.

Ray Train's preemption watcher polls the GCS for draining nodes (a spot reclaim the cloud
announced, ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) and marks every worker
of the run. ``RayPreemptionNotices.poll`` reads that mark on this worker without a collective, at
every step boundary; the loop's stop agreement (one asynchronous all-reduce per step) shares
it, and every rank saves the step it finished.

After the agreement every rank asks ``ray.train.get_preemption_info()`` once (a barrier, so
all ranks act on the same answer: which node, which ranks, the deadline); they save, and
``wait_for_preemption`` logs the node and its deadline and waits for the node to go. Ray
Train's controller restarts the run when the node is gone or its deadline has passed, from
the checkpoint just saved, and counts the restart against
``FailureConfig.max_preemption_failures`` rather than ``max_failures``.

With ``scaling.relax_collectives_on_preemption`` (ddp only: every rank holds the whole model
and optimizer) the preempted node's ranks do not take part in the save: rank 0 writes it
alone, without a collective, and Ray's report barrier waits only for the ranks that stay.
So a node that dies before the save is done costs nothing.

Why wait rather than train on, as Ray's docstring suggests: every step trained after the
save would be trained again after the restart, which comes at the deadline either way; waiting
costs the same time and repeats no step. A drain that is never carried out is ended by the
controller at the deadline as well, from the same checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NoReturn

from convoy.engine.stop import StopNotice, StopRequested
from convoy.errors import LaunchError
from convoy.launchers.ray_stop import DriverStopReader

NO_RESTART_AFTER_S = 60.0
"""How long past the deadline a worker waits for Ray Train's restart before giving up: the
controller ends the group as soon as the deadline (plus ``preemption_grace_s``) passes."""


class RayPreemptionNotices:
    """Ray Train's preemption notices, and the driver's stop requests, as the loop's
    ``NoticeSource``.

    ``relax``: ``scaling.relax_collectives_on_preemption`` (ddp: every rank holds the whole
    model), under which the ranks off the preempted node save without it. ``driver``: where
    the driver's stop request is read (``convoy.launchers.ray_stop``), if it makes one.
    """

    def __init__(self, relax: bool = False, driver: DriverStopReader | None = None) -> None:
        self.relax = relax
        self.driver = driver

    def poll(self) -> StopNotice | None:
        """Ray Train's preemption mark on this worker (no collective), else the driver's
        request."""
        from ray.train.v2._internal.execution.context import get_train_context

        info = get_train_context().preemption_context.preemption_info
        if info is None:
            return self.driver.poll() if self.driver is not None else None
        return StopNotice(f"preemption of {_nodes(info)}", time.time(), _deadline(info))

    def confirm(self, notice: StopNotice) -> StopNotice:
        """Every rank asks ``ray.train.get_preemption_info()`` once (a barrier, so all act on
        the same answer); a stop that is not a preemption stays as it was."""
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return notice
        ranks = tuple(info.preempted_ranks)
        return StopNotice(
            f"preemption of {_nodes(info)}",
            notice.received_at,
            _deadline(info),
            preempted_ranks=ranks,
            # Ray relaxes its barriers only while rank 0 survives (it holds the reports).
            relaxed=self.relax and 0 not in ranks,
        )


def wait_for_preemption(stopped: StopRequested, rank: int) -> NoReturn:
    """After a stop on a node preemption: say so and wait for Ray Train to restart the run
    (it ends this worker); any other stop is re-raised."""
    notice = stopped.notice
    if notice is None or not notice.preempted_ranks:
        raise stopped
    if rank == 0:
        left = notice.seconds_left()
        when = f"deadline in {left:.1f} s" if left is not None else "no deadline given"
        # Written, not printed: Ray Train's patched print() would show the line twice.
        sys.stdout.write(
            f"convoy: {notice.source.removeprefix('preemption of ')} (ranks "
            f"{list(notice.preempted_ranks)}) is being preempted, {when}: waiting for it to go; "
            "Ray Train then restarts the run from the checkpoint just saved (a restart counted "
            "against scaling.max_preemption_failures)\n"
        )
        sys.stdout.flush()
    # Ray Train ends this worker once the node is gone or its deadline has passed.
    give_up = (notice.deadline or time.time() + 120.0) + NO_RESTART_AFTER_S
    while time.time() < give_up:
        time.sleep(0.5)
    raise stopped


def _deadline(info: Any) -> float | None:
    return info.deadline_ms / 1000 if info.deadline_ms else None


def _nodes(info: Any) -> str:
    """``node 10.0.0.2 (5f0c1a2b)`` for each preempted node: its IP if Ray still lists it."""
    import ray

    addresses = {node["NodeID"]: node.get("NodeManagerAddress", "?") for node in _listed_nodes(ray)}
    named = [
        f"node {addresses.get(node_id, '?')} ({node_id[:8]})" for node_id in info.preempted_node_ids
    ]
    return ", ".join(named) or "a node"


def _listed_nodes(ray: Any) -> list[dict[str, Any]]:
    try:
        return list(ray.nodes())
    except Exception:  # the log line is worth less than the wait: never fail on it
        return []


def drain_this_node(deadline_s: float, address: str | None = None, wait: bool = True) -> None:
    """Mark this machine's Ray node as preempted, ``deadline_s`` from now (what a cloud's
    spot notice does through the autoscaler), and wait until then: a Ray worker pod's
    preStop hook, so the node's train workers save before Kubernetes' SIGTERM ends Ray."""
    import ray.util
    from ray._raylet import GcsClient  # type: ignore[attr-defined]
    from ray.core.generated import autoscaler_pb2

    address = address or os.environ.get("RAY_ADDRESS") or _kuberay_gcs_address()
    if not address:
        raise LaunchError(
            "convoy k8s drain-node: no Ray cluster address: pass --address, or set "
            "RAY_ADDRESS (KubeRay's worker pods have FQ_RAY_IP)"
        )
    gcs = GcsClient(address=address)
    ip = ray.util.get_node_ip_address()
    nodes = [i for i in gcs.get_all_node_info().values() if i.state == 0]  # ALIVE
    mine = [i.node_id.hex() for i in nodes if i.node_manager_address == ip]
    if not mine:
        raise LaunchError(
            f"convoy k8s drain-node: no live Ray node at {ip} in the cluster at {address}"
        )
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, why = gcs.drain_node(
        mine[0],
        autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
            "DRAIN_NODE_REASON_PREEMPTION"
        ),
        "convoy k8s drain-node: the pod is stopping",
        deadline_ms,
    )
    if not accepted:
        raise LaunchError(f"convoy k8s drain-node: Ray refused to drain node {ip}: {why}")
    sys.stdout.write(
        f"convoy: drained Ray node {ip} ({mine[0][:8]}), deadline in {deadline_s:g} s\n"
    )
    sys.stdout.flush()
    if wait:
        time.sleep(max(0.0, deadline_ms / 1000 - time.time()))


def _kuberay_gcs_address() -> str | None:
    import os

    host = os.environ.get("FQ_RAY_IP")
    return f"{host}:6379" if host else None
