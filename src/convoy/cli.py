"""``convoy``: the one command-line entry point.

    convoy train RECIPE.yaml [-o key.path=value ...]
    convoy config show RECIPE.yaml [-o key.path=value ...]
    convoy export RUN_DIR [--checkpoint step_N] --format safetensors
    convoy evaluate EXPORT_DIR
    convoy list
    convoy k8s render|submit|status|logs|delete|gc ...

Errors caused by input (a bad config, a missing dataset, an impossible resource request) are
printed as one paragraph without a traceback, with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from convoy.commands import add_override_arg
from convoy.commands import add_parsers as add_command_parsers
from convoy.config import Job, job_to_yaml, layout_name, load_job
from convoy.engine.progress import PERCENT_METRICS
from convoy.engine.stop import STOPPED_EXIT_CODE, StopRequested
from convoy.errors import ConvoyError

EXAMPLES = """\
examples:
  convoy train recipes/default.yaml
  convoy train recipes/default.yaml -o strategy.name=fsdp2 -o scaling.num_workers=2
  convoy train recipes/digits_mlp.yaml -o optim.lr=3e-3 -o run.epochs=5
  convoy train recipes/lm_tiny.yaml -o scaling.launcher=torchrun
  convoy config show recipes/default.yaml -o scaling.launcher=torchrun
  convoy data convert ~/data/cifar-10-python.tar.gz ~/data/cifar10-parquet
"""


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="YAML recipe; the built-in defaults if omitted")
    add_override_arg(parser, "optim.lr=3e-4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convoy",
        description="Distributed PyTorch training on Ray: one recipe, five strategies "
        "(single, ddp, fsdp, fsdp2, hsdp), three launchers (local, torchrun, ray).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser(
        "train",
        help="train a recipe",
        description="Validate the recipe, start its launcher's workers and train. Outputs go "
        "to <run.storage_dir>/<run.name>/: config.yaml, metrics.jsonl, summary.json.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_recipe_args(train)

    config = commands.add_parser("config", help="inspect configs", description="Inspect configs.")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_commands.add_parser(
        "show",
        help="print the resolved, validated config",
        description="Load a recipe, apply overrides, validate everything that can be checked "
        "before a worker starts, and print the resolved config as YAML.",
    )
    _add_recipe_args(show)

    export = commands.add_parser(
        "export",
        help="export a checkpoint to one safetensors file",
        description="Consolidate a run's checkpoint (sharded by any strategy and world size) "
        "into one single-device model.safetensors plus model.json, loadable with plain PyTorch.",
    )
    export.add_argument(
        "run", help="the run directory, <run.storage_dir>/<run.name> (a path or s3:// URI)"
    )
    export.add_argument(
        "--checkpoint", help="a checkpoint name like step_00000312 (default: latest)"
    )
    export.add_argument("--format", choices=["safetensors"], default="safetensors")
    export.add_argument(
        "--out",
        help="output directory (default: <run>/export/<checkpoint>; for an s3:// run, "
        "./export/<run name>/<checkpoint>)",
    )

    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate an exported model on its test split",
        description="Load an export (no process group, no pickle) and compute its test metrics "
        "on the job's dataset; prints them beside the metrics recorded at training time.",
    )
    evaluate.add_argument("export", help="a directory written by convoy export")
    add_override_arg(evaluate, "data.path=/new/place")

    commands.add_parser(
        "list",
        help="list tasks, models, datasets, strategies and launchers",
        description="List the names each registry accepts.",
    )
    _add_data_commands(commands)
    _add_k8s_commands(commands)
    add_command_parsers(commands)
    return parser


def _add_data_commands(commands: Any) -> None:
    data = commands.add_parser(
        "data", help="prepare, convert and inspect datasets", description="Dataset tools."
    )
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    imagenet = actions.add_parser(
        "prepare-imagenet",
        help="ILSVRC train/ + flat val/ + LOC_val_solution.csv -> an ImageFolder tree",
        description="Hard-link (or copy) ILSVRC images into DST/train/<wnid>/ and "
        "DST/val/<wnid>/. Idempotent; reports missing, unlabeled and unreadable files.",
    )
    imagenet.add_argument("src", help="folder with train/, val/ and LOC_val_solution.csv")
    imagenet.add_argument("dst", help="the ImageFolder tree to create or complete")
    convert = actions.add_parser(
        "convert",
        help="an ImageFolder tree or CIFAR-10 batches -> parquet shards",
        description="Write parquet shards (index, image bytes, label, name) and classes.json; "
        "unreadable or missing files are left out and reported.",
    )
    convert.add_argument("src", help="ImageFolder tree, or CIFAR-10 batches (folder or .tar.gz)")
    convert.add_argument("dst", help="output folder")
    convert.add_argument("--format", choices=["parquet"], default="parquet")
    convert.add_argument(
        "--shard-mb", type=float, default=256.0, help="target shard size in MiB (default 256)"
    )
    synth = actions.add_parser(
        "synth-telematics",
        help="write a fleet's accelerometer/gyroscope windows with driving events (parquet)",
        description="Seeded synthetic telematics: DEVICES vehicles x HOURS of 6-channel "
        "series cut into labelled windows (normal, harsh_brake, harsh_accel, sharp_turn, "
        "pothole), split by device into train/val/test parquet shards that data.name: series "
        "streams. OUT is a folder or s3://bucket/prefix.",
    )
    synth.add_argument("out", help="output folder or s3://bucket/prefix")
    synth.add_argument("--devices", type=int, required=True, help="vehicles (at least 3)")
    synth.add_argument("--hours", type=float, required=True, help="hours recorded per vehicle")
    synth.add_argument("--rate-hz", type=int, default=20, help="samples per second (default 20)")
    synth.add_argument("--window-s", type=float, default=10.0, help="seconds per window (10)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--shard-mb", type=float, default=64.0, help="MiB per shard (64)")
    synth.add_argument("--rows-per-group", type=int, default=512, help="rows per row group (512)")
    synth.add_argument(
        "--layout",
        choices=["lists", "packed"],
        default="lists",
        help="channels as list<float32> (default) or packed float32 bytes, read faster",
    )
    inspect = actions.add_parser(
        "inspect",
        help="counts, class balance, image sizes and unreadable files of a dataset",
        description="Read an ImageFolder tree, a parquet dataset or CIFAR-10 batches and report.",
    )
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")


def cmd_train(args: argparse.Namespace) -> int:
    import convoy

    job = load_job(args.recipe, args.override)
    print(optimizer_line(job), flush=True)  # before any launcher output
    result = convoy.train(job)
    print(format_summary(result.summary, str(result.run_dir)))
    return 0


def optimizer_line(job: Job) -> str:
    """What ``convoy train`` says first: the optimizer and schedule the run will use, and
    which of their fields the recipe left to their defaults."""
    if job.lightning.enabled:
        return f"convoy: optimizer and schedule from {job.lightning.module}.configure_optimizers"
    from convoy.engine.schedule import peak_lr

    cfg = job.optim
    shown: dict[str, Any] = {"lr": peak_lr(cfg, job.data.batch_size), **cfg.hyperparameters}
    if cfg.scale_lr_base_batch is not None:
        shown["lr"] = (
            f"{shown['lr']:g} ({cfg.lr:g} x {job.data.batch_size}/{cfg.scale_lr_base_batch})"
        )
    schedule: dict[str, Any] = {"warmup_steps": cfg.warmup_steps}
    if cfg.schedule == "cosine":
        schedule["min_lr_ratio"] = cfg.min_lr_ratio
    epochs = f"{job.run.epochs} epoch{'s' if job.run.epochs != 1 else ''}"
    if job.run.max_steps is not None:
        epochs += f", at most {job.run.max_steps} steps"
    fields = ["name", *shown, "schedule", *schedule]
    defaults = [key for key in fields if key not in cfg.model_fields_set]
    return (
        f"convoy: optimizer {cfg.name}({_keywords(shown)}) | schedule {cfg.schedule}"
        f"({_keywords(schedule)}) over {epochs}"
        + (f" | defaults: {', '.join(defaults)}" if defaults else "")
    )


def _keywords(values: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )


def cmd_config_show(args: argparse.Namespace) -> int:
    from convoy.preflight import preflight

    print(job_to_yaml(preflight(load_job(args.recipe, args.override))), end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from convoy.export import export_checkpoint, find_checkpoint
    from convoy.storage import is_remote

    checkpoint = find_checkpoint(args.run, args.checkpoint)
    if args.out:
        out = Path(args.out)
    elif is_remote(args.run):  # next to where the command runs: exports are local files
        out = Path("export") / args.run.rstrip("/").rsplit("/", 1)[-1] / checkpoint
    else:
        out = Path(args.run) / "export" / checkpoint
    print(f"exported {checkpoint} to {export_checkpoint(args.run, out, checkpoint)}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from convoy.export import MODEL_FILE, evaluate_exported

    export_dir = Path(args.export)
    recorded = json.loads((export_dir / MODEL_FILE).read_text()).get("metrics", {})
    measured = evaluate_exported(export_dir, args.override)
    print(f"{'metric':<16}{'measured':>14}{'recorded':>14}")
    for key, value in measured.items():
        before = recorded.get(key)
        shown = (value, before) if before is not None else (value,)
        print(f"{key:<16}" + "".join(_evaluated(key, v) for v in shown))
    return 0


def _evaluated(key: str, value: float) -> str:
    """A count as an integer, any other metric to six decimals."""
    if key.rpartition("/")[2] in COUNT_COLUMNS:
        return f"{int(value):>14}"
    return f"{value:>14.6f}"


def cmd_list(_: argparse.Namespace) -> int:
    from convoy.config import STRATEGY_NAMES
    from convoy.data.registry import DATASETS
    from convoy.launchers import LAUNCHER_NAMES
    from convoy.models.registry import MODELS
    from convoy.tasks import TASKS

    print("tasks:      " + ", ".join(TASKS) + "  (or package.module:Class)")
    print("models:     " + ", ".join(MODELS) + "  (or package.module:factory)")
    print("datasets:   " + ", ".join(DATASETS) + "  (or package.module:function)")
    print("strategies: " + ", ".join(STRATEGY_NAMES))
    print("launchers:  " + ", ".join(LAUNCHER_NAMES))
    return 0


def format_summary(summary: dict[str, Any], run_dir: str) -> str:
    """The table printed at the end of ``convoy train``: every metric of every split, the
    data's reference figures (e.g. gzip's bits per byte) beside them."""
    metrics = dict(summary["metrics"])
    references = summary.get("reference_metrics") or {}
    columns = _metric_columns(metrics, references)
    lines = ["", f"{'split':<8}" + "".join(f"{c:>12}" for c in columns)]
    for split in ("train", "val", "test"):
        if f"{split}/loss" not in metrics:
            continue
        values = {**references, **metrics}
        cells = [_cell(column, values.get(f"{split}/{column}")) for column in columns]
        lines.append(f"{split:<8}" + "".join(cells))
    # A Lightning run's metrics keep the names the module logged (val_loss, test_acc).
    named = {key: value for key, value in metrics.items() if "/" not in key}
    if named:
        if len(lines) == 2:  # no split/name rows: drop their empty header
            lines = []
        lines += ["", f"{'metric':<16}{'value':>12}"]
        lines += [f"{key:<16}{value:>12.4f}" for key, value in named.items()]
    memory = ", ".join(f"{m / 2**20:,.0f}" for m in summary["peak_memory_bytes_per_rank"])
    step = summary["step_seconds_median"]
    lines += [
        "",
        f"{summary.get('task', 'classification')}: "
        f"{layout_name(summary['strategy'], summary.get('tp_size', 1))} x "
        f"{summary['world_size']} on {summary['launcher']}, "
        f"{summary['precision']}, {summary['steps']} steps",
        f"wall {summary['wall_seconds']:.1f} s | step {1000 * step:.1f} ms (median after "
        f"warm-up) | data wait {_data_wait(summary)}"
        if step is not None
        else f"wall {summary['wall_seconds']:.1f} s",
        *_rates_line(summary),
        f"peak memory per rank (MiB): {memory}",
    ]
    if summary.get("compile_seconds") is not None:
        lines.append(
            f"torch.compile: {summary['compile_seconds']:.1f} s compiling (not in the step times)"
        )
    throughput = _throughput_line(summary)
    if throughput:
        lines.append(throughput)
    lines.append(f"run dir: {run_dir}")
    return "\n".join(lines)


def _data_wait(summary: dict[str, Any]) -> str:
    """The data-wait fraction; with the first batch apart where it weighs (a pipeline's
    start is paid once, and a short run shows mostly that)."""
    whole = f"{100 * summary['data_wait_fraction']:.1f}%"
    first, after = summary.get("first_batch_seconds"), summary.get("data_wait_fraction_after_first")
    if first is None or after is None or summary["data_wait_fraction"] - after < 0.01:
        return whole
    return f"{whole} ({100 * after:.1f}% after the first batch, which took {first:.2f} s)"


def _rates_line(summary: dict[str, Any]) -> list[str]:
    """``steady 13,900 samples/s | whole run 12,400 samples/s``: the median step's rate beside
    the whole run's (which counts the first steps and each epoch's start)."""
    count = "tokens" if "tokens_per_second" in summary else "samples"
    steady = summary.get(f"steady_{count}_per_second")
    whole = summary.get(f"{count}_per_second", summary.get("samples_per_second"))
    if whole is None:
        return []
    if steady is None:
        return [f"whole run {whole:,.0f} {count}/s"]
    return [f"steady {steady:,.0f} {count}/s (median step) | whole run {whole:,.0f} {count}/s"]


def _throughput_line(summary: dict[str, Any]) -> str:
    """``compute: 5.76 GFLOP/sample | steady 0.22 TFLOP/s MFU 45.1% | whole run 0.18 TFLOP/s
    MFU 41.0% of 989 TFLOP/s per device (NVIDIA H100)``."""
    flops = summary.get("flops_per_sample")
    if flops is None or summary.get("tflops_per_second") is None:
        return ""
    from convoy.engine.flops import format_flops, format_throughput

    device = summary.get("device_name", "cpu")
    text = format_throughput(summary["tflops_per_second"], summary.get("mfu"), device == "cpu")
    if summary.get("steady_tflops_per_second") is not None:
        steady = format_throughput(
            summary["steady_tflops_per_second"], summary.get("steady_mfu"), device == "cpu"
        )
        text = f"steady {steady} | whole run {text}"
    peak = summary.get("peak_flops_per_device")
    where = f" of {peak / 1e12:,.0f} TFLOP/s per device" if peak else ""
    return f"compute: {format_flops(flops, 'FLOP/sample')} | {text}{where} ({device})"


COUNT_COLUMNS = ("samples", "tokens")


def _metric_columns(metrics: dict[str, float], references: dict[str, float]) -> list[str]:
    """Metric names in the order first seen (loss first, counts last), plus references."""
    names = dict.fromkeys(["loss"])
    for key in [*metrics, *references]:
        names.setdefault(key.partition("/")[2])
    ordered = [n for n in names if n not in COUNT_COLUMNS and n != "bytes"]
    return ordered + [n for n in COUNT_COLUMNS if n in names]


def _cell(column: str, value: float | None) -> str:
    if value is None:
        return f"{'-':>12}"
    if column in PERCENT_METRICS:
        return f"{100 * value:>11.2f}%"
    if column in COUNT_COLUMNS:
        return f"{int(value):>12}"
    return f"{value:>12.4f}"


def _synth_telematics(args: argparse.Namespace) -> int:
    from convoy.data.telematics import FleetSpec, write_fleet

    spec = FleetSpec(
        args.devices,
        args.hours,
        args.rate_hz,
        args.window_s,
        args.seed,
        args.shard_mb,
        args.rows_per_group,
        args.layout,
    )
    summary = write_fleet(spec, args.out)
    rows = ", ".join(f"{split} {count:,}" for split, count in summary["rows"].items())
    mib = sum(summary["rows"].values()) * summary["bytes_per_row"] / 2**20
    print(
        f"wrote {args.out}: {spec.devices} devices, windows of {spec.steps} steps x "
        f"{len(summary['channels'])} channels; rows {rows} ({mib:,.1f} MiB of float32 series)"
    )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    if args.data_command == "prepare-imagenet":
        from convoy.data.imagenet import prepare_imagenet

        print("\n".join(prepare_imagenet(Path(args.src), Path(args.dst)).lines()))
        return 0
    if args.data_command == "synth-telematics":
        return _synth_telematics(args)
    from convoy.data.convert import convert_dataset, inspect_dataset, report_lines

    if args.data_command == "convert":
        report = convert_dataset(Path(args.src), Path(args.dst), args.shard_mb)
        print("\n".join(report_lines(report)))
        print(f"wrote {args.dst}")
        return 0
    report = inspect_dataset(Path(args.path))
    print(json.dumps(report, indent=2) if args.json else "\n".join(report_lines(report)))
    return 0


K8S_EXAMPLES = """\
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
K8S_KINDS = ("rayjob", "raycluster", "pytorchjob")


def _add_k8s_commands(commands: Any) -> None:
    k8s = commands.add_parser(
        "k8s",
        help="run a recipe on Kubernetes (KubeRay RayJob / RayCluster, Kubeflow PyTorchJob)",
        description="Render a recipe as Kubernetes objects, check them against the KubeRay "
        "v1.7.0 CRDs (schema, CEL rules, the operator's own checks) and the pods' resources, "
        "submit them, follow their status, read logs, delete, and clean up what runs left "
        "behind. Settings live in the recipe's k8s section (see convoy.config.K8sConfig).",
        epilog=K8S_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = k8s.add_subparsers(dest="k8s_command", metavar="ACTION", required=True)
    render = actions.add_parser(
        "render",
        help="print the manifests for a recipe (YAML)",
        description="Write the recipe ConfigMap and the workload that runs `convoy train` on "
        "the resolved recipe. Nothing is written unless every check passes.",
    )
    _add_k8s_source(render)
    render.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    validate = actions.add_parser(
        "validate",
        help="check a manifest file (rendered or edited) without a cluster",
        description="Check every document of a YAML file against the shipped CRD schemas, "
        "their CEL rules, the KubeRay operator's reconcile-time checks and Convoy's pod policy.",
    )
    validate.add_argument("file", help="a YAML file of manifests ('-': standard input)")
    submit = actions.add_parser(
        "submit",
        help="validate and create a recipe's (or a manifest file's) objects",
        description="Render (or read) the manifests, validate them, create the ConfigMap and "
        "the workload. Exits 0 once created; with --watch, follows it to the end and exits 0 "
        "on success, 1 on failure.",
    )
    _add_k8s_source(submit)
    submit.add_argument("--dry-run", action="store_true", help="server-side dry run only")
    submit.add_argument("--watch", action="store_true", help="follow the status to the end")
    _add_k8s_cluster_args(submit, namespace=False)
    for action, text in [
        ("status", "show a workload's state (jobDeploymentStatus, reason, job status)"),
        ("logs", "print the logs of a RayJob's submitter (the driver's output)"),
        ("delete", "delete a workload and its recipe ConfigMap"),
    ]:
        sub = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        sub.add_argument("name", help="the workload's name (the run id)")
        sub.add_argument("--kind", choices=K8S_KINDS, default="rayjob")
        _add_k8s_cluster_args(sub)
        if action == "status":
            sub.add_argument("--watch", action="store_true", help="follow until it ends")
            sub.add_argument("--timeout", type=float, help="give up watching after SECONDS")
        if action == "logs":
            sub.add_argument("--tail", type=int, help="only the last N lines")
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
    gc = actions.add_parser(
        "gc",
        help="delete what Convoy's runs left behind",
        description="Delete Convoy-labelled objects left behind: RayJobs and PyTorchJobs "
        "finished longer ago than their TTL, recipe ConfigMaps whose run is gone, and "
        "RayClusters whose RayJob is gone. RayClusters rendered on purpose are kept.",
    )
    _add_k8s_cluster_args(gc)
    gc.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    gc.add_argument(
        "--grace", type=float, default=600.0, help="seconds an orphan must be old (default 600)"
    )


def _grace_warnings(manifests: list[Any]) -> list[str]:
    """Pods whose grace period is shorter than their run's last measured save."""
    from convoy.k8s.configmap import recipe_job
    from convoy.k8s.grace import grace_warnings

    recipes = [
        text
        for m in manifests
        if m.get("kind") == "ConfigMap"
        for text in (m.get("data") or {}).values()
    ]
    return [w for text in recipes[:1] for w in grace_warnings(recipe_job(text), manifests)]


def _add_k8s_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?", help="YAML recipe, or (submit) a file of rendered manifests"
    )
    add_override_arg(parser, "k8s.image=registry.example.com/convoy:0.1.0")
    parser.add_argument(
        "--kind", choices=K8S_KINDS, help="what to render (default: k8s.kind, rayjob)"
    )


def _add_k8s_cluster_args(parser: argparse.ArgumentParser, namespace: bool = True) -> None:
    if namespace:
        parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    parser.add_argument("--context", help="a context of the kubeconfig")


def _read_manifests(path: str) -> list[Any]:
    """The YAML documents of ``path`` ('-': standard input); one-line errors."""
    import yaml

    from convoy.k8s import K8sError

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


def _k8s_manifests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Render the recipe, or read a file of manifests (anything with an apiVersion)."""
    import yaml

    from convoy.k8s import K8sError
    from convoy.k8s.render import render

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
    return render(load_job(args.recipe, args.override), args.kind)


def _k8s_render(args: argparse.Namespace) -> int:
    from convoy.k8s.render import to_yaml
    from convoy.k8s.validate import check_manifests

    manifests = _k8s_manifests(args)
    check_manifests(manifests)
    text = to_yaml(manifests)
    if not args.out:
        print(text, end="")
        return 0
    try:
        with open(args.out, "w") as handle:
            handle.write(text)
    except OSError as exc:
        from convoy.k8s import K8sError

        raise K8sError(f"--out {args.out}: cannot write it ({exc.strerror or exc})") from None
    return 0


def _k8s_validate(args: argparse.Namespace) -> int:
    from convoy.k8s import K8sError
    from convoy.k8s.validate import check_manifests

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


def _k8s_drain_node(args: argparse.Namespace) -> int:
    from convoy.launchers.ray_preemption import drain_this_node

    drain_this_node(args.deadline_s, args.address, wait=not args.no_wait)
    return 0


def cmd_k8s(args: argparse.Namespace) -> int:
    from convoy.k8s import control

    local = {"render": _k8s_render, "validate": _k8s_validate, "drain-node": _k8s_drain_node}
    if args.k8s_command in local:
        return local[args.k8s_command](args)
    from convoy.k8s.client import BY_KIND, KubeApi

    if args.k8s_command == "submit":
        from convoy.k8s.validate import check_manifests

        manifests = _k8s_manifests(args)
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
    api = KubeApi.connect(args.kubeconfig, args.context)
    if args.k8s_command == "gc":
        found = control.gc(api, args.namespace, grace_s=args.grace, dry_run=args.dry_run)
        for item in found:
            print(("would delete " if args.dry_run else "deleted ") + item.line())
        if not found:
            print(f"nothing to collect in namespace {args.namespace}")
        return 0
    resource = BY_KIND[
        {"rayjob": "RayJob", "raycluster": "RayCluster"}.get(args.kind, "PyTorchJob")
    ]
    if args.k8s_command == "status":
        if not args.watch:
            _print_state(control.state(api, resource, args.namespace, args.name))
            return 0
        final = control.follow(
            api, resource, args.namespace, args.name, _print_state, timeout_s=args.timeout
        )
        return 0 if final.succeeded else 1
    if args.k8s_command == "logs":
        print(control.logs(api, resource, args.namespace, args.name, args.tail), end="")
        return 0
    for line in control.delete(api, resource, args.namespace, args.name):
        print(f"deleted {line}")
    return 0


def _print_state(state: Any) -> None:
    print("\n".join(state.lines()), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # As `python -m` does: the user's own modules (model.name / data.name / task.name given as
    # package.module:attr) import from the directory convoy is run in. Ray's workers and
    # torchrun's `python -m` workers put the same directory on their path.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    handlers = {
        "train": cmd_train,
        "list": cmd_list,
        "export": cmd_export,
        "evaluate": cmd_evaluate,
        "data": cmd_data,
        "k8s": cmd_k8s,
    }
    handler = getattr(args, "handler", None) or (
        cmd_config_show if args.command == "config" else handlers[args.command]
    )
    try:
        return handler(args)
    except StopRequested as exc:
        command = shlex.join(["convoy", *(sys.argv[1:] if argv is None else argv)])
        again = "to resume" if exc.saved else "to start again"
        shown = "" if exc.shown else f"convoy: {exc}\n"
        print(f"{shown}convoy: {again}: {command}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    except ConvoyError as exc:
        print(f"convoy: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["Job", "build_parser", "main"]
