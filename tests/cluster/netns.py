"""Test hosts: several "machines" on this one, made of Linux network namespaces, and real
multi-node Ray clusters on them, started the way a user or KubeRay starts them.

``TestHosts(n).create()`` makes ``n`` network namespaces ``convoy-<pid>-<serial>-h<i>``, each
with ``lo`` up and an ``eth0`` (one end of a veth pair) on a bridge ``cvy<pid>b<n>`` in the
root namespace. Addresses come from a free ``10.213.<k>.0/24``, chosen at runtime among the
ones this machine does not route yet: the bridge holds ``.1`` (so the root namespace reaches
every host, and each host's default route points there), host ``i`` holds ``.<i + 2>``.
``host.run(...)`` / ``host.popen(...)`` run a command inside a host (``ip netns exec``).

What is *not* separate, on purpose or by nature:

* Hostnames (the UTS namespace) and ``/etc/hosts``: ``socket.gethostname()`` is the same in
  every host and resolves as on the machine, typically to ``127.0.0.1`` or ``127.0.1.1``,
  which inside a namespace is that host's own loopback. A process that advertises "the
  address my hostname resolves to" (gloo does) therefore advertises an address the other
  hosts cannot reach: the real multi-node failure, reproduced rather than papered over
  (there is no per-namespace ``/etc/netns/<name>/hosts``).
* Processes (the PID namespace) and files (``/tmp``, ``/dev/shm``). ``ray stop`` would kill
  every Ray on the machine, other tests' included, so nothing here uses it: a node's
  processes are told apart by their process group and parentage inside the host's network
  namespace. ``ray.init("auto")`` and ``ray status`` without an address find GCS servers with
  ``ps``, i.e. any Ray on the machine: a driver must be given an explicit address
  (``RAY_ADDRESS``, see ``RayNodes.driver_env``).

Teardown (``TestHosts.close``, idempotent, also registered with ``atexit``) kills every
process started through a host (by process group), then every process left in the hosts'
namespaces (by PID), then deletes this object's own veths, namespaces and bridge by name.
Creating hosts first removes what earlier runs left behind: names of the same patterns whose
pid is no longer alive.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETNS_PATTERN = re.compile(r"^convoy-(\d+)-(?:\d+-h\d+|probe)$")
LINK_PATTERN = re.compile(r"^cvy(\d+)[bv]\d+$")  # bridges and the root ends of veth pairs
TMP_PATTERN = re.compile(r"^cvy(\d+)-\d+h\d+$")  # /tmp/cvy<pid>-<serial>h<i>
SUBNET_PREFIX = "10.213"  # 10.213.<k>.0/24, k chosen free at runtime
LOCK_FILE = Path("/tmp/convoy-test-hosts.lock")
NETNS_ETC = Path("/etc/netns")  # per-namespace files `ip netns exec` mounts over /etc
TMP_ROOT = Path("/tmp")  # short paths: Ray's unix sockets live under the temp dir (107 chars)
IP_TIMEOUT_S = 30
# What `ip` says where the machine (not the code) is the obstacle: no privilege, no support.
UNAVAILABLE_HINTS = (
    "Operation not permitted",
    "Permission denied",
    "not supported",
    "Unknown device type",
    "Read-only file system",
)

_serials = itertools.count()
_links = itertools.count()


class HostsUnavailable(RuntimeError):
    """This machine cannot make test hosts; the message says why."""


class HostsError(RuntimeError):
    """Making or tearing down test hosts failed."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; on failure raise ``HostsUnavailable`` or ``HostsError``."""
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        message = f"`ip {' '.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        if any(hint in done.stderr for hint in UNAVAILABLE_HINTS):
            raise HostsUnavailable(message)
        raise HostsError(message)
    return done


def cannot_make_hosts() -> str | None:
    """Why this machine cannot make test hosts, or None if it can."""
    if not sys.platform.startswith("linux"):
        return f"test hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"test hosts need root for `ip netns add`; running as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "test hosts need the `ip` binary (iproute2); it is not on PATH"
    probe = f"convoy-{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except (HostsUnavailable, HostsError, OSError, subprocess.SubprocessError) as error:
        return f"cannot make test hosts here: {error}"
    ip("netns", "del", probe, check=False)
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(netns: str) -> set[int]:
    """The processes whose network namespace is ``netns`` (zombies are not listed)."""
    done = ip("netns", "pids", netns, check=False)
    return {int(word) for word in done.stdout.split() if word.isdigit()}


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) of a live process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[2])


def signal_pids(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """Wait until none of ``pids`` is running (zombies count as gone); return the rest."""
    deadline = time.monotonic() + timeout
    left = set(pids)
    while True:
        left = {pid for pid in left if proc_running(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def proc_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def kill_namespace(netns: str, timeout: float = 10.0) -> set[int]:
    """SIGKILL every process in ``netns`` until none is left; return those that survived."""
    deadline = time.monotonic() + timeout
    while True:
        pids = namespace_pids(netns)
        if not pids:
            return set()
        signal_pids(pids, signal.SIGKILL)
        left = wait_gone(pids, max(0.1, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            return left | namespace_pids(netns)


def list_netns() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    return [link["ifname"] for link in json.loads(ip("-j", "link", "show").stdout or "[]")]


def routed_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the root namespace routes or has an address in."""
    networks = []
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            networks.append(ipaddress.ip_network(dst, strict=False))
    for link in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for addr in link.get("addr_info", []):
            networks.append(
                ipaddress.ip_network(f"{addr['local']}/{addr['prefixlen']}", strict=False)
            )
    return networks


def free_subnet() -> ipaddress.IPv4Network:
    used = routed_networks()
    for k in range(1, 255):
        candidate = ipaddress.ip_network(f"{SUBNET_PREFIX}.{k}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise HostsError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16 for test hosts")


def remove_stale() -> list[str]:
    """Delete namespaces, links and temp dirs of these patterns whose pid is gone."""
    removed = []
    for name in list_netns():
        match = NETNS_PATTERN.match(name)
        if match and not pid_alive(int(match.group(1))):
            kill_namespace(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for name in list_links():
        match = LINK_PATTERN.match(name)
        if match and not pid_alive(int(match.group(1))):
            ip("link", "del", name, check=False)
            removed.append(name)
    for path in TMP_ROOT.iterdir():
        match = TMP_PATTERN.match(path.name)
        if match and path.is_dir() and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    for path in NETNS_ETC.glob("convoy-*") if NETNS_ETC.is_dir() else []:
        match = NETNS_PATTERN.match(path.name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Serialize subnet choice and stale cleanup between concurrent test runs."""
    with open(LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_resolver(netns: str) -> None:
    """Give a host a resolver that fails at once instead of after 10 s.

    ``ip netns exec`` bind-mounts ``/etc/netns/<name>/resolv.conf`` over ``/etc/resolv.conf``.
    The machine's nameserver is not reachable from the hosts (no NAT), and gloo / c10d look
    up peers' names while forming a process group: each lookup would wait out the resolver's
    timeout. A real node reaches its DNS; here "nameserver on the host's own loopback" is
    refused at once. Host names themselves still resolve through ``/etc/hosts``, as on the
    machine (see the module docstring).
    """
    folder = NETNS_ETC / netns
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def merged_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """``os.environ`` updated with ``env``; a value of None removes the variable."""
    merged = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


@dataclass
class Host:
    """One test host: a network namespace with ``eth0`` at ``ip``."""

    name: str  # h0, h1, ...
    netns: str  # convoy-<pid>-<serial>-h<i>
    ip: str
    tmp_dir: Path  # short, per host: /tmp/cvy<pid>-<serial>h<i>
    owner: TestHosts = field(repr=False)

    def command(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(
        self, cmd: Sequence[str], env: Mapping[str, str | None] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` in this host, in a new session; teardown kills its process group.

        ``env`` updates this process's environment (None removes a variable).
        """
        popen.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(cmd), env=merged_env(env), **popen)
        self.owner.processes.append(process)
        return process

    def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str | None] | None = None,
        timeout: float | None = 120,
        check: bool = False,
        **popen: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``cmd`` in this host to completion; output captured as text unless redirected.

        On timeout its process group is killed and ``subprocess.TimeoutExpired`` raised with
        what it printed. Captured output ends only when every holder of the pipe exits: a
        daemon it starts must get its own stdout/stderr, or ``run`` waits for the timeout.
        """
        if "stdout" not in popen and "stderr" not in popen:
            popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        popen.setdefault("text", True)
        process = self.popen(cmd, env=env, **popen)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            raise subprocess.TimeoutExpired(list(cmd), timeout or 0, out, err) from None
        done = subprocess.CompletedProcess(list(cmd), process.returncode, out, err)
        if check:
            done.check_returncode()
        return done


class TestHosts:
    """``count`` test hosts on one bridge; ``create()`` makes them, ``close()`` removes them."""

    __test__ = False  # not a test class

    def __init__(self, count: int = 2) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"count: got {count}, want 1..200")
        self.count = count
        self.pid = os.getpid()
        self.serial = next(_serials)
        self.bridge = f"cvy{self.pid}b{self.serial}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""  # the bridge's address, .1
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen[Any]] = []
        self.namespaces: list[str] = []  # created (or being created), for teardown
        self.veths: list[str] = []
        self.closed = False

    def __enter__(self) -> TestHosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def create(self) -> TestHosts:
        atexit.register(self.close)
        with machine_lock():
            remove_stale()
            self.subnet = free_subnet()
            addresses = list(self.subnet.hosts())
            self.gateway = str(addresses[0])
            prefix = self.subnet.prefixlen
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            netns = f"convoy-{self.pid}-{self.serial}-h{i}"
            veth = f"cvy{self.pid}v{next(_links)}"
            host_ip = str(addresses[i + 1])
            self.namespaces.append(netns)
            ip("netns", "add", netns)
            write_resolver(netns)
            self.veths.append(veth)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", netns, "addr", "add", f"{host_ip}/{prefix}", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            ip("-n", netns, "link", "set", "lo", "up")
            ip("-n", netns, "route", "add", "default", "via", self.gateway)
            tmp_dir = TMP_ROOT / f"cvy{self.pid}-{self.serial}h{i}"
            tmp_dir.mkdir(mode=0o700, exist_ok=True)
            self.hosts.append(Host(f"h{i}", netns, host_ip, tmp_dir, self))
        return self

    def own_pids(self) -> set[int]:
        """Every live process in these hosts' namespaces."""
        pids: set[int] = set()
        for netns in self.namespaces:
            pids |= namespace_pids(netns)
        return pids

    def close(self) -> None:
        """Kill every process started here, then delete these namespaces, veths and bridge.

        Attempts every step; raises ``HostsError`` at the end if something is left.
        """
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        problems = []
        for process in self.processes:
            if process.poll() is None:  # not reaped: its pid, and so its group id, is still ours
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append(f"process {process.pid} did not exit after SIGKILL")
        for netns in self.namespaces:
            left = kill_namespace(netns)
            if left:
                problems.append(f"processes {sorted(left)} still run in {netns}")
        existing_links = set(list_links())
        for veth in self.veths:
            if veth in existing_links:
                ip("link", "del", veth, check=False)
        existing_netns = set(list_netns())
        for netns in self.namespaces:
            if netns in existing_netns:
                done = ip("netns", "del", netns, check=False)
                if done.returncode != 0:
                    problems.append(f"ip netns del {netns}: {done.stderr.strip()}")
        if self.bridge in existing_links:
            done = ip("link", "del", self.bridge, check=False)
            if done.returncode != 0:
                problems.append(f"ip link del {self.bridge}: {done.stderr.strip()}")
        for host in self.hosts:
            shutil.rmtree(host.tmp_dir, ignore_errors=True)
        for netns in self.namespaces:
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        links, namespaces = set(list_links()), set(list_netns())
        leftovers = [n for n in self.namespaces if n in namespaces]
        leftovers += [name for name in [self.bridge, *self.veths] if name in links]
        if leftovers:
            problems.append(f"still present: {leftovers}")
        if problems:
            raise HostsError("test hosts teardown: " + "; ".join(problems))


# For the head (``start_head(..., env=FAST_NODE_DEATH_ENV)``): the GCS declares a node dead
# after 3 failed health checks 0.5 s apart, instead of Ray's 5 x 3 s (measured ~15 s here).
FAST_NODE_DEATH_ENV = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


def new_token() -> str:
    """A cluster token in Ray's own format (``ray get-auth-token --generate``: 32 random
    bytes as hex)."""
    return secrets.token_hex(32)


class RayStartError(RuntimeError):
    """``ray start`` failed or timed out; the message ends with what it printed."""


@dataclass
class RayNode:
    """One Ray node started with ``ray start`` in a test host."""

    host: Host
    head: bool
    address: str  # the cluster's GCS address, ip:port
    token: str
    num_cpus: float
    pgid: int  # the process group `ray start` made; its daemons stay in it
    output: str  # what `ray start` printed
    dashboard_url: str | None = None

    @property
    def ip(self) -> str:
        return self.host.ip

    def pids(self) -> set[int]:
        """This node's live processes: ``ray start``'s process group and all descendants
        (Ray's workers make their own groups), within the host's network namespace."""
        in_netns = namespace_pids(self.host.netns)
        stats = {pid: stat for pid in in_netns if (stat := proc_stat(pid)) is not None}
        members = {pid for pid, (_, pgid) in stats.items() if pgid == self.pgid}
        while True:
            children = {pid for pid, (ppid, _) in stats.items() if ppid in members} - members
            if not children:
                return members
            members |= children

    def alive(self) -> bool:
        return bool(self.pids())


class RayNodes:
    """Ray nodes on test hosts, with token authentication on, and no ``ray stop``.

    ``start_head`` / ``start_worker`` run ``ray start`` in a host with the host's IP, a short
    per-host ``--temp-dir`` and ``RAY_AUTH_MODE=token`` plus the token in ``RAY_AUTH_TOKEN``
    (``ray start --head`` never creates a token in this mode: it must be given one). The
    head runs the dashboard (state API, job submission) bound to the head's IP, so it is
    reachable from every host and from the root namespace. ``stop()`` kills only the
    processes of the nodes started here.
    """

    def __init__(self, ray_bin: str | None = None, object_store_memory: int = 128 << 20) -> None:
        self.ray_bin = ray_bin or str(Path(sys.executable).with_name("ray"))
        self.object_store_memory = object_store_memory
        self.token = new_token()  # one per cluster
        self.nodes: list[RayNode] = []

    @property
    def head(self) -> RayNode:
        heads = [node for node in self.nodes if node.head]
        if not heads:
            raise RuntimeError("no head node started")
        return heads[-1]

    def node_env(self, token: str, env: Mapping[str, str | None] | None) -> dict[str, str | None]:
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "RAY_AUTH_TOKEN_PATH": None,
            "RAY_ADDRESS": None,
            **(env or {}),
        }

    def _start(
        self,
        host: Host,
        args: list[str],
        token: str,
        env: Mapping[str, str | None] | None,
        timeout: float,
    ) -> tuple[int, str]:
        log = host.tmp_dir / f"ray-start-{len(self.nodes)}.log"
        cmd = [
            self.ray_bin,
            "start",
            *args,
            f"--node-ip-address={host.ip}",
            f"--temp-dir={host.tmp_dir}",
            "--disable-usage-stats",
            f"--object-store-memory={self.object_store_memory}",
        ]
        with open(log, "w") as out:
            process = host.popen(
                cmd, env=self.node_env(token, env), stdout=out, stderr=subprocess.STDOUT
            )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        output = log.read_text(errors="replace")
        if code != 0:
            # Its daemons share its process group: take them down with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            what = f"timed out after {timeout:g}s" if code is None else f"exited {code}"
            raise RayStartError(f"`ray start {' '.join(args)}` in {host.name} {what}:\n{output}")
        return process.pid, output

    def start_head(
        self,
        host: Host,
        num_cpus: float = 1,
        token: str | None = None,
        port: int = 6379,
        env: Mapping[str, str | None] | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = 120,
    ) -> RayNode:
        """``ray start --head`` in ``host`` with the dashboard on ``<host ip>:8265``."""
        token = token or self.token
        args = [
            "--head",
            f"--port={port}",
            f"--num-cpus={num_cpus:g}",
            "--include-dashboard=true",
            f"--dashboard-host={host.ip}",
            "--dashboard-port=8265",
            *extra_args,
        ]
        pgid, output = self._start(host, args, token, env, timeout)
        node = RayNode(
            host,
            head=True,
            address=f"{host.ip}:{port}",
            token=token,
            num_cpus=num_cpus,
            pgid=pgid,
            output=output,
            dashboard_url=f"http://{host.ip}:8265",
        )
        self.nodes.append(node)
        return node

    def start_worker(
        self,
        host: Host,
        head_address: str,
        num_cpus: float = 1,
        token: str | None = None,
        env: Mapping[str, str | None] | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = 120,
    ) -> RayNode:
        """``ray start --address=<head_address>`` in ``host``."""
        token = token or self.token
        args = [f"--address={head_address}", f"--num-cpus={num_cpus:g}", *extra_args]
        pgid, output = self._start(host, args, token, env, timeout)
        node = RayNode(host, False, head_address, token, num_cpus, pgid, output)
        self.nodes.append(node)
        return node

    def add_worker(self, host: Host, num_cpus: float = 1, **kwargs: Any) -> RayNode:
        """A worker joining the running cluster later, with the head's token."""
        head = self.head
        return self.start_worker(host, head.address, num_cpus, token=head.token, **kwargs)

    def driver_env(self, token: bool = True) -> dict[str, str | None]:
        """Environment for a driver in a host (``host.run(..., env=...)``): the explicit
        address, and the token unless ``token=False`` (then no auth variables at all)."""
        head = self.head
        if token:
            return {
                "RAY_ADDRESS": head.address,
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": head.token,
                "RAY_AUTH_TOKEN_PATH": None,
            }
        return {
            "RAY_ADDRESS": head.address,
            "RAY_AUTH_MODE": None,
            "RAY_AUTH_TOKEN": None,
            "RAY_AUTH_TOKEN_PATH": None,
        }

    def kill_node(self, node: RayNode, timeout: float = 10.0) -> None:
        """SIGKILL the node's raylet and everything under it, as if the machine died.

        The processes are stopped first (SIGSTOP) until no new child appears, so a worker
        forked meanwhile is not missed, then killed together.
        """
        frozen: set[int] = set()
        for _ in range(20):
            pids = node.pids() - frozen
            if not pids:
                break
            signal_pids(pids, signal.SIGSTOP)
            frozen |= pids
        signal_pids(frozen, signal.SIGKILL)
        left = wait_gone(frozen, timeout)
        if left:
            raise RuntimeError(f"node {node.host.name}: processes {sorted(left)} survived SIGKILL")

    def stop(self) -> None:
        """Kill every node started here (workers first); other Rays are left alone."""
        for node in sorted(self.nodes, key=lambda n: n.head):
            self.kill_node(node)
