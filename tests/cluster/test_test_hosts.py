"""Test hosts reach each other and leave nothing behind; a token-auth Ray cluster on them
takes a driver with the token and refuses one without it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from netns import (
    FAST_NODE_DEATH_ENV,
    LOCK_FILE,
    RayNodes,
    TestHosts,
    cannot_make_hosts,
    ip,
    list_links,
    list_netns,
    pid_alive,
    proc_running,
)

pytestmark = [pytest.mark.cluster]

LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
for _ in range(2):
    conn, peer = server.accept()
    conn.sendall(peer[0].encode())
    conn.close()
"""
CONNECT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
    print(conn.recv(100).decode())
"""


def test_hosts_reach_each_other_over_tcp(make_test_hosts: Callable[[int], TestHosts]) -> None:
    h0, h1 = make_test_hosts(2)
    assert h0.ip != h1.ip
    listener = h1.popen([sys.executable, "-c", LISTEN, h1.ip], stdout=subprocess.PIPE, text=True)
    port = listener.stdout.readline().strip()  # type: ignore[union-attr]
    # Host to host: the listener sees the connection come from h0's address.
    done = h0.run([sys.executable, "-c", CONNECT, h1.ip, port], timeout=30, check=True)
    assert done.stdout.strip() == h0.ip
    # The root namespace reaches hosts through the bridge (from its .1 address).
    done = subprocess.run(
        [sys.executable, "-c", CONNECT, h1.ip, port], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == h0.owner.gateway
    assert listener.wait(timeout=10) == 0


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


DETACH = """
import subprocess
daemon = subprocess.Popen(
    ["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
)
print(daemon.pid, flush=True)
"""


def test_teardown_leaves_nothing_behind() -> None:
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(reason)
    # What a run killed before its teardown leaves: a namespace, a bridge, a temp dir.
    gone = dead_pid()
    stale_netns, stale_bridge = f"convoy-{gone}-0-h0", f"cvy{gone}b0"
    ip("netns", "add", stale_netns)
    ip("link", "add", stale_bridge, "type", "bridge")
    stale_dir = LOCK_FILE.parent / f"cvy{gone}-0h0"
    stale_dir.mkdir(exist_ok=True)

    hosts = TestHosts(2)
    try:
        hosts.create()
        assert stale_netns not in list_netns()
        assert stale_bridge not in list_links()
        assert not stale_dir.exists()
        own_netns, own_links = list(hosts.namespaces), [hosts.bridge, *hosts.veths]
        assert set(own_netns) <= set(list_netns()) and set(own_links) <= set(list_links())
        sleeper = hosts[0].popen(["sleep", "600"])
        # A daemon that left the process group it was started in, as Ray's processes do.
        done = hosts[1].run([sys.executable, "-c", DETACH], check=True)
        daemon = int(done.stdout)
        assert proc_running(daemon)
        assert {sleeper.pid, daemon} <= hosts.own_pids()
    finally:
        hosts.close()
    assert not pid_alive(sleeper.pid)
    assert not proc_running(daemon)
    assert not set(own_netns) & set(list_netns())
    assert not set(own_links) & set(list_links())
    assert not any(host.tmp_dir.exists() for host in hosts)
    hosts.close()  # idempotent


@pytest.fixture(scope="module")
def cluster(
    module_test_hosts: Callable[[int], TestHosts],
) -> Iterator[tuple[TestHosts, RayNodes]]:
    """A 2-node token-auth Ray cluster (head h0, worker h1); h2 is free to join later."""
    hosts = module_test_hosts(3)
    nodes = RayNodes()
    try:
        head = nodes.start_head(hosts[0], num_cpus=1, env=FAST_NODE_DEATH_ENV)
        nodes.start_worker(hosts[1], head.address, num_cpus=1)
        yield hosts, nodes
    finally:
        nodes.stop()


DRIVER = """
import json, sys, time
import ray
from ray.util.state import list_nodes

want, worker_ip = int(sys.argv[1]), sys.argv[2]
ray.init(logging_config=ray.LoggingConfig(log_level="ERROR"))
deadline = time.monotonic() + 60
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) == want or time.monotonic() > deadline:
        break
    time.sleep(0.2)

@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address()

ran_on = ray.get(where.options(resources={f"node:{worker_ip}": 0.01}).remote(), timeout=60)
print(json.dumps({
    "alive": alive,
    "ran_on": ran_on,
    "driver_ip": ray.util.get_node_ip_address(),
    "state_api_nodes": len([n for n in list_nodes() if n.state == "ALIVE"]),
}))
"""


def run_driver(hosts: TestHosts, nodes: RayNodes, want: int, worker_ip: str) -> dict:  # type: ignore[type-arg]
    done = hosts[0].run(
        [sys.executable, "-c", DRIVER, str(want), worker_ip],
        env=nodes.driver_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_driver_with_the_token_runs_a_task_on_the_worker_node(
    cluster: tuple[TestHosts, RayNodes],
) -> None:
    hosts, nodes = cluster
    seen = run_driver(hosts, nodes, 2, hosts[1].ip)
    assert seen == {
        "alive": sorted([hosts[0].ip, hosts[1].ip]),
        "ran_on": hosts[1].ip,
        "driver_ip": hosts[0].ip,
        "state_api_nodes": 2,
    }


REFUSED = """
import time
import ray
start = time.monotonic()
try:
    ray.init()
except Exception as error:
    print(f"REFUSED after {time.monotonic() - start:.1f}s: {type(error).__name__}: {error}")
    print(f"CAUSE: {error.__cause__}")
else:
    print("CONNECTED")
"""


@pytest.mark.parametrize("auth", ["no auth variables", "a wrong token"])
def test_driver_without_the_token_is_refused(
    cluster: tuple[TestHosts, RayNodes], auth: str
) -> None:
    """Ray retries the GCS RAY_NUM_REDIS_GET_RETRIES times, 1 s apart (20 by default, ~20 s),
    logging "Unauthenticated ... InvalidAuthToken" each time, then raises ConnectionError."""
    hosts, nodes = cluster
    env = nodes.driver_env(token=auth != "no auth variables")
    if auth == "a wrong token":
        env["RAY_AUTH_TOKEN"] = "0" * 64
    env["RAY_NUM_REDIS_GET_RETRIES"] = "3"
    start = time.monotonic()
    done = hosts[0].run([sys.executable, "-c", REFUSED], env=env, timeout=60)
    elapsed = time.monotonic() - start
    assert "CONNECTED" not in done.stdout
    assert f"ConnectionError: Failed to connect to Ray cluster at {nodes.head.address}" in (
        done.stdout
    )
    assert "InvalidAuthToken: Authentication token is missing or incorrect" in done.stdout
    assert "Unauthenticated" in done.stderr
    assert elapsed < 30


def test_a_node_dies_and_another_joins(cluster: tuple[TestHosts, RayNodes]) -> None:
    hosts, nodes = cluster
    worker = next(node for node in nodes.nodes if not node.head)
    nodes.add_worker(hosts[2], num_cpus=1)
    nodes.kill_node(worker)
    assert not worker.alive()
    seen = run_driver(hosts, nodes, 2, hosts[2].ip)
    assert seen["alive"] == sorted([hosts[0].ip, hosts[2].ip])
    assert seen["ran_on"] == hosts[2].ip
