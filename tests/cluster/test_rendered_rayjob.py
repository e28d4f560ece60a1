"""A rendered RayJob, played on test hosts: its pods' ``ray start`` lines form a real
three-node Ray cluster with token auth, and its entrypoint trains the recipe on it.

``convoy k8s render recipes/default.yaml --kind rayjob`` (1 epoch, 2 workers of 1 CPU, one per
worker pod) gives the manifests; ``ray_start_commands`` reads from them what KubeRay would
run: the head's and each worker pod's ``ray start`` line (``rayStartParams`` plus the
container limits), the Ray containers' environment (token auth), the entrypoint and the
ConfigMap's recipe. The head pod runs on h0, the two worker pods on h1 and h2, each line as
it is (``--block`` included, in the background, killed by process group at teardown: no
``ray stop``). The entrypoint then runs on h0 and must finish the run with its two train
workers on the two worker pods, none on the head (``num-cpus: 0``).

What stands in for what cannot exist here:

* The pods: network-namespace hosts, one per pod, each with its own IP (Ray finds it by
  itself, as in a pod: the hosts' default route is their ``eth0``). The head Service's DNS
  name: the head's IP, given to ``ray_start_commands`` as ``head_address``.
* The image: this virtual environment's ``ray`` and ``convoy``, first on ``PATH`` (the
  manifest's ``rayVersion`` must be its Ray's version).
* The Ray token Secret KubeRay makes: a fresh token, in ``RAY_AUTH_TOKEN`` as the operator
  injects it into every Ray container.
* Each pod's own ``/tmp`` emptyDir (Ray's session directory): a per-host ``--temp-dir``, added
  to the ``ray start`` lines, since the hosts share this machine's ``/tmp``.
* The ``/dev/shm`` memory emptyDir: this machine's ``/dev/shm``, shared by the hosts. Ray sizes
  its object store from the container's memory limit in a pod; here there is no such cgroup,
  so ``--object-store-memory`` (128 MiB) is added, as ``RayNodes`` does.
* ``--disable-usage-stats`` is added: nothing outside the machine is reachable.
* The cluster DNS: the machine's nameserver is out of the hosts' reach, so each reverse
  lookup (c10d makes some as the process group forms) waits out glibc's timeout, 10 s;
  ``RES_OPTIONS=timeout:1 attempts:1`` in every container's environment cuts that to 1 s.
* The PVC, mounted at ``/mnt/convoy-shared`` in the pods: a directory under this test's tmp
  dir, which every host sees; the recipe's ``run.storage_dir`` is rewritten to it (the
  renderer refuses a mount under ``/tmp``, the pods' own emptyDir).
* The recipe ConfigMap mounted at ``/etc/convoy``: its files are written under the tmp dir
  and the entrypoint's paths rewritten to them.
* The submitter pod (``ray job submit`` to the head's dashboard): the entrypoint runs
  directly as a driver on h0, with the head container's environment and ``RAY_ADDRESS`` set
  to the GCS address, as Ray's job supervisor sets it.

Not exercised: the operator, the Service, container limits (cgroups) and security contexts,
the flags KubeRay adds to ``ray start`` of its own (metrics and agent ports), deadlines, TTL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path, PurePosixPath

import pytest
import yaml
from netns import Host, RayNode, RayNodes, TestHosts

from convoy.k8s.render import RECIPE_DIR, RayStartPlan, ray_start_commands

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # not resolved: the venv's bin, with ray and convoy
GCS_PORT = 6379
CONVOY = [sys.executable, "-m", "convoy"]
RUN_NAME = "rendered-rayjob"
POD_SHARED = "/mnt/convoy-shared"  # where the rendered pods mount the PVC
STARTED = "This command will now block forever"  # `ray start --block`, once the node is up


def render_rayjob() -> list[dict]:
    """``convoy k8s render`` as a user runs it (it also checks the manifests)."""
    overrides = [
        "k8s.image=registry.example.com/convoy:0.1.0",
        "k8s.pvc=convoy-runs",
        f"k8s.pvc_mount_path={POD_SHARED}",
        f"run.name={RUN_NAME}",
        "run.epochs=1",
        "run.progress=plain",
    ]
    recipe = str(REPO / "recipes" / "default.yaml")
    done = subprocess.run(
        [*CONVOY, "k8s", "render", recipe, "--kind", "rayjob", *(f"-o{o}" for o in overrides)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def pod_env(plan: RayStartPlan) -> dict[str, str | None]:
    """A Ray container's environment: the plan's, on the image's PATH, without this
    process's Ray address or token file."""
    return {
        "RAY_ADDRESS": None,
        "RAY_AUTH_TOKEN_PATH": None,
        **plan.env,
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "RES_OPTIONS": "timeout:1 attempts:1",  # the cluster DNS: see the module docstring
    }


def start_pod(host: Host, command: list[str], env: dict[str, str | None]) -> subprocess.Popen:
    """Run a pod's ``ray start`` line in ``host`` with the flags that replace its volumes."""
    assert command[:2] == ["ray", "start"] and "--block" in command, command
    local = [
        f"--temp-dir={host.tmp_dir}",  # the pod's /tmp emptyDir
        f"--object-store-memory={128 << 20}",  # sized from the pod's memory limit there
        "--disable-usage-stats",
    ]
    with open(host.tmp_dir / "ray-start.log", "w") as log:
        return host.popen([*command, *local], env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_started(
    nodes: RayNodes, host: Host, process: subprocess.Popen, head_ip: str, token: str
) -> RayNode:
    """Wait until the blocking ``ray start`` says the node is up; hand it to ``nodes`` so the
    fixture kills it (its process group and descendants) before the hosts go."""
    log = host.tmp_dir / "ray-start.log"
    deadline = time.monotonic() + 90
    while STARTED not in (output := log.read_text(errors="replace")):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the pod on {host.name} did not start ({process.poll()}):\n{output}")
        time.sleep(0.2)
    cpus = next(float(a.split("=")[1]) for a in process.args if str(a).startswith("--num-cpus="))
    is_head = host.ip == head_ip
    node = RayNode(host, is_head, f"{head_ip}:{GCS_PORT}", token, cpus, process.pid, output)
    nodes.nodes.append(node)
    return node


def test_a_rendered_rayjob_runs_on_test_hosts(
    make_test_hosts: Callable[[int], TestHosts], ray_nodes: RayNodes, tmp_path: Path
) -> None:
    began = time.monotonic()
    head, *workers = make_test_hosts(3)
    manifests = render_rayjob()
    cluster = manifests[-1]["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == version("ray")  # the "image" runs the Ray it names
    plan = ray_start_commands(manifests, head.ip, ray_nodes.token, gcs_port=GCS_PORT)
    assert len(plan.workers) == len(workers) == 2  # one train worker per worker pod
    env = pod_env(plan)

    rendered = time.monotonic()
    process = start_pod(head, plan.head, env)
    wait_started(ray_nodes, head, process, head.ip, ray_nodes.token)
    started = [
        (host, start_pod(host, cmd, env)) for host, cmd in zip(workers, plan.workers, strict=True)
    ]
    for host, process in started:
        wait_started(ray_nodes, host, process, head.ip, ray_nodes.token)
    up = time.monotonic()

    # The ConfigMap's files, at tmp paths: the entrypoint's pod paths are rewritten to them,
    # and the PVC's mount path in the recipe (run.storage_dir) to a tmp directory.
    entrypoint = plan.entrypoint
    for pod_path, text in plan.files.items():
        local = tmp_path / "configmap" / PurePosixPath(pod_path).relative_to(RECIPE_DIR)
        local.parent.mkdir(parents=True, exist_ok=True)
        assert f"storage_dir: {POD_SHARED}/" in text
        local.write_text(text.replace(POD_SHARED, str(tmp_path / "shared")))
        assert pod_path in entrypoint, (pod_path, entrypoint)
        entrypoint = entrypoint.replace(pod_path, str(local))

    # The submitter's job: the entrypoint on the head, with the head container's environment.
    done = head.run(
        ["sh", "-c", entrypoint], env={**env, "RAY_ADDRESS": f"{head.ip}:{GCS_PORT}"}, timeout=300
    )
    ended = time.monotonic()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    # The worker group: one train worker on each worker pod, none on the head (num-cpus 0).
    for host in workers:
        assert f"ip={host.ip}" in output, output[-5000:]
    assert f"ip={head.ip}" not in output, output[-5000:]
    summary = json.loads((tmp_path / "shared" / "runs" / RUN_NAME / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert {"test/acc", "test/loss"} <= set(summary["metrics"]), summary["metrics"]
    print(
        f"\nhosts + render {rendered - began:.1f} s, three pods up {up - rendered:.1f} s, "
        f"entrypoint {ended - up:.1f} s; test acc {summary['metrics']['test/acc']:.4f}"
    )
