"""``convoy k8s render | validate | submit | status | logs | delete | drain-node | gc``: a
recipe on Kubernetes (KubeRay RayJob / RayCluster, Kubeflow PyTorchJob).

Each action is one handler here; ``HANDLERS`` maps the action names to them. ``render``,
``validate`` and ``drain-node`` need no API server; the others connect first (``submit``
only after its manifests passed every check).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import yaml

from convoy.commands.common import add_override_arg
from convoy.config import load_job
from convoy.k8s import K8sError, control
from convoy.k8s.client import BY_KIND, KubeApi
from convoy.k8s.configmap import recipe_job
from convoy.k8s.grace import grace_warnings
from convoy.k8s.validate import check_manifests
from convoy.launchers.ray_preemption import drain_this_node

EXAMPLES = """\
examples:
  convoy k8s render recipes/default.yaml -o k8s.image=registry.example.com/convoy:0.1.0 \\
      -o k8s.pvc=convoy-runs > rayjob.yaml
  convoy k8s render recipes/default.yaml --kind pytorchjob -o k8s.image=... -o k8s.pvc=...
  convoy k8s validate rayjob.yaml
  convoy k8s submit rayjob.yaml --watch
  convoy k8s status digits-vit --watch
  convoy k8s logs digits-vit
  convoy k8s delete digits-vit
  convoy k8s gc --dry-run
"""
KINDS = ("rayjob", "raycluster", "pytorchjob")
# The actions on one named workload, in the order `convoy k8s --help` lists them.
WORKLOAD_ACTIONS = [
    ("status", "show a workload's state (jobDeploymentStatus, reason, job status)"),
    ("logs", "print the logs of a RayJob's submitter (the driver's output)"),
    ("delete", "delete a workload and its recipe ConfigMap"),
]


def add_parser(commands: Any) -> None:
    """Add ``k8s`` and its actions to ``convoy``'s sub-parsers."""
    k8s = commands.add_parser(
        "k8s",
        help="run a recipe on Kubernetes (KubeRay RayJob / RayCluster, Kubeflow PyTorchJob)",
        description="Render a recipe as Kubernetes objects, check them against the KubeRay "
        "v1.7.0 CRDs (schema, CEL rules, the operator's own checks) and the pods' resources, "
        "submit them, follow their status, read logs, delete, and clean up what runs left "
        "behind. Settings live in the recipe's k8s section (see convoy.config.K8sConfig).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = k8s.add_subparsers(dest="k8s_command", metavar="ACTION", required=True)
    _add_render_parser(actions)
    _add_validate_parser(actions)
    _add_submit_parser(actions)
    _add_workload_parsers(actions)
    _add_drain_node_parser(actions)
    _add_gc_parser(actions)
    for name, parser in actions.choices.items():
        parser.set_defaults(handler=HANDLERS[name])


def _add_render_parser(actions: Any) -> None:
    render = actions.add_parser(
        "render",
        help="print the manifests for a recipe (YAML)",
        description="Write the recipe ConfigMap and the workload that runs `convoy train` on "
        "the resolved recipe. Nothing is written unless every check passes.",
    )
    _add_source_args(render)
    render.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")


def _add_validate_parser(actions: Any) -> None:
    validate = actions.add_parser(
        "validate",
        help="check a manifest file (rendered or edited) without a cluster",
        description="Check every document of a YAML file against the shipped CRD schemas, "
        "their CEL rules, the KubeRay operator's reconcile-time checks and Convoy's pod policy.",
    )
    validate.add_argument("file", help="a YAML file of manifests ('-': standard input)")


def _add_submit_parser(actions: Any) -> None:
    submit = actions.add_parser(
        "submit",
        help="validate and create a recipe's (or a manifest file's) objects",
        description="Render (or read) the manifests, validate them, create the ConfigMap and "
        "the workload. Exits 0 once created; with --watch, follows it to the end and exits 0 "
        "on success, 1 on failure.",
    )
    _add_source_args(submit)
    submit.add_argument("--dry-run", action="store_true", help="server-side dry run only")
    submit.add_argument("--watch", action="store_true", help="follow the status to the end")
    _add_cluster_args(submit, namespace=False)


def _add_workload_parsers(actions: Any) -> None:
    for action, text in WORKLOAD_ACTIONS:
        sub = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        sub.add_argument("name", help="the workload's name (the run id)")
        sub.add_argument("--kind", choices=KINDS, default="rayjob")
        _add_cluster_args(sub)
        if action == "status":
            sub.add_argument("--watch", action="store_true", help="follow until it ends")
            sub.add_argument("--timeout", type=float, help="give up watching after SECONDS")
        if action == "logs":
            sub.add_argument("--tail", type=int, help="only the last N lines")


def _add_drain_node_parser(actions: Any) -> None:
    drain = actions.add_parser(
        "drain-node",
        help="drain this pod's Ray node as a preemption, then wait out its deadline",
        description="A Ray worker pod's preStop hook (rendered): mark this machine's Ray node "
        "as preempted with a deadline, so Ray Train's workers on it save the step they "
        "finished, then wait until the deadline before Kubernetes' SIGTERM ends Ray.",
    )
    drain.add_argument(
        "--deadline-s", type=float, required=True, help="seconds until the node goes"
    )
    drain.add_argument(
        "--address",
        help="the cluster's GCS address (default: $RAY_ADDRESS, or KubeRay's $FQ_RAY_IP:6379)",
    )
    drain.add_argument("--no-wait", action="store_true", help="return once the drain is asked")


def _add_gc_parser(actions: Any) -> None:
    gc = actions.add_parser(
        "gc",
        help="delete what Convoy's runs left behind",
        description="Delete Convoy-labelled objects left behind: RayJobs and PyTorchJobs "
        "finished longer ago than their TTL, recipe ConfigMaps whose run is gone, and "
        "RayClusters whose RayJob is gone. RayClusters rendered on purpose are kept.",
    )
    _add_cluster_args(gc)
    gc.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    gc.add_argument(
        "--grace", type=float, default=600.0, help="seconds an orphan must be old (default 600)"
    )


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    """A recipe (with overrides and a kind to render) or a file of rendered manifests."""
    parser.add_argument(
        "recipe", nargs="?", help="YAML recipe, or (submit) a file of rendered manifests"
    )
    add_override_arg(parser, "k8s.image=registry.example.com/convoy:0.1.0")
    parser.add_argument("--kind", choices=KINDS, help="what to render (default: k8s.kind, rayjob)")


def _add_cluster_args(parser: argparse.ArgumentParser, namespace: bool = True) -> None:
    """Where the API server is: the kubeconfig, its context and (not for submit, whose
    manifests name it) the namespace."""
    if namespace:
        parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    parser.add_argument("--context", help="a context of the kubeconfig")


def render(args: argparse.Namespace) -> int:
    """Print (or write to --out) the checked manifests of a recipe."""
    from convoy.k8s.render import to_yaml  # torch: see _manifests

    manifests = _manifests(args)
    check_manifests(manifests)
    text = to_yaml(manifests)
    if not args.out:
        print(text, end="")
        return 0
    try:
        with open(args.out, "w") as handle:
            handle.write(text)
    except OSError as exc:
        raise K8sError(f"--out {args.out}: cannot write it ({exc.strerror or exc})") from None
    return 0


def validate(args: argparse.Namespace) -> int:
    """Check a file of manifests without a cluster; warn of short grace periods."""
    manifests = _read_manifests(args.file)
    if not manifests:
        raise K8sError(f"{args.file}: no manifests (the file holds no YAML documents)")
    if any(not isinstance(m, dict) for m in manifests):
        raise K8sError(f"{args.file}: every YAML document must be a mapping (a manifest)")
    check_manifests(manifests)
    print(f"{args.file}: {len(manifests)} manifest(s) valid")
    for warning in _grace_warnings(manifests):
        print(f"convoy: warning: {warning}", file=sys.stderr)
    return 0


def drain_node(args: argparse.Namespace) -> int:
    """Drain this pod's Ray node as a preemption (a preStop hook)."""
    drain_this_node(args.deadline_s, args.address, wait=not args.no_wait)
    return 0


def submit(args: argparse.Namespace) -> int:
    """Create the workload; with --watch, follow it: 0 on success, 1 on failure."""
    manifests = _manifests(args)
    check_manifests(manifests)  # before connecting: a typo needs no cluster to report
    api = KubeApi.connect(args.kubeconfig, args.context)
    created = control.submit(api, manifests, dry_run=args.dry_run)
    meta = created["metadata"]
    verb = "would create" if args.dry_run else "created"
    print(f"{verb} {created['kind']} {meta['namespace']}/{meta['name']}")
    if not args.watch or args.dry_run:
        return 0
    resource, namespace, name = BY_KIND[created["kind"]], meta["namespace"], meta["name"]
    final = control.follow(api, resource, namespace, name, _print_state)
    return 0 if final.succeeded else 1


def gc(args: argparse.Namespace) -> int:
    """Delete (or, --dry-run, list) what Convoy's runs left behind in the namespace."""
    api = KubeApi.connect(args.kubeconfig, args.context)
    found = control.gc(api, args.namespace, grace_s=args.grace, dry_run=args.dry_run)
    for item in found:
        print(("would delete " if args.dry_run else "deleted ") + item.line())
    if not found:
        print(f"nothing to collect in namespace {args.namespace}")
    return 0


def status(args: argparse.Namespace) -> int:
    """Print a workload's state; with --watch, follow it: 0 on success, 1 on failure."""
    api, resource = _connect_to_workload(args)
    if not args.watch:
        _print_state(control.state(api, resource, args.namespace, args.name))
        return 0
    final = control.follow(
        api, resource, args.namespace, args.name, _print_state, timeout_s=args.timeout
    )
    return 0 if final.succeeded else 1


def logs(args: argparse.Namespace) -> int:
    """Print a RayJob submitter's logs."""
    api, resource = _connect_to_workload(args)
    print(control.logs(api, resource, args.namespace, args.name, args.tail), end="")
    return 0


def delete(args: argparse.Namespace) -> int:
    """Delete a workload and its recipe ConfigMap; print what went."""
    api, resource = _connect_to_workload(args)
    for line in control.delete(api, resource, args.namespace, args.name):
        print(f"deleted {line}")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "render": render,
    "validate": validate,
    "submit": submit,
    "status": status,
    "logs": logs,
    "delete": delete,
    "drain-node": drain_node,
    "gc": gc,
}


def _connect_to_workload(args: argparse.Namespace) -> tuple[Any, Any]:
    """The API and the resource (RayJob, RayCluster or PyTorchJob) that --kind names."""
    api = KubeApi.connect(args.kubeconfig, args.context)
    resource = BY_KIND[
        {"rayjob": "RayJob", "raycluster": "RayCluster"}.get(args.kind, "PyTorchJob")
    ]
    return api, resource


def _print_state(state: Any) -> None:
    print("\n".join(state.lines()), flush=True)


def _grace_warnings(manifests: list[Any]) -> list[str]:
    """Pods whose grace period is shorter than their run's last measured save."""
    recipes = [
        text
        for m in manifests
        if m.get("kind") == "ConfigMap"
        for text in (m.get("data") or {}).values()
    ]
    return [w for text in recipes[:1] for w in grace_warnings(recipe_job(text), manifests)]


def _read_manifests(path: str) -> list[Any]:
    """The YAML documents of ``path`` ('-': standard input); one-line errors."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path) as handle:
                text = handle.read()
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except OSError as exc:
        raise K8sError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise K8sError(f"{path}: not valid YAML{line}: {problem}") from None


def _manifests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Render the recipe, or read a file of manifests (anything with an apiVersion)."""
    if args.recipe:
        try:
            with open(args.recipe) as handle:
                documents = [d for d in yaml.safe_load_all(handle) if d]
        except (OSError, yaml.YAMLError):
            documents = []
        if documents and all(isinstance(d, dict) and "apiVersion" in d for d in documents):
            if args.override or args.kind:
                flag = "-o/--override" if args.override else "--kind"
                raise K8sError(
                    f"{args.recipe}: a file of rendered manifests; {flag} applies only to a "
                    "recipe (render the recipe again with it, or edit the manifest)"
                )
            return documents
    # Rendering imports torch (the grace period counts the model's parameters): imported
    # here, not above, so that `convoy k8s status|logs|delete|gc` and every other command's
    # start import no torch.
    from convoy.k8s.render import render as render_job

    return render_job(load_job(args.recipe, args.override), args.kind)
