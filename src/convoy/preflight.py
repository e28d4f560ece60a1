"""Checks that import code, read files or build the model and data: run once, in the driver.

The config schema (``convoy.config``) is pure, so a recorded job can be loaded anywhere (an
export on another machine, a worker). ``preflight`` is the one place that touches the outside
world before any worker starts: the task, model and data factories import; the data loads;
the task accepts the data; the model, built on the meta device (no memory, any size), runs on
one real batch and its output fits the task (classes, vocabulary, context length);
``checkpoint.best_metric`` is a metric the task reports; a tracking sink whose library is not
installed is off (``resolve_tracking``); the planned peak per rank fits a rank's memory here
(``check_memory``). Every failure is one ``ConfigError`` naming the field and value (the
memory check's a ``ResourceError``).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import default_collate

from convoy.batches import move_to, tensors_in
from convoy.config import Job, layout_name, micro_batch, tp_size_of
from convoy.data.base import Splits
from convoy.data.registry import check_dataset, check_loaded, load_splits
from convoy.data.shards import ShardedSplit
from convoy.dynamo_guard import defer_meta_guards
from convoy.engine.flops import small_enough_to_run
from convoy.engine.sinks import TRACKING_SINKS
from convoy.errors import ConfigError, ConvoyError, ResourceError, one_of
from convoy.imports import installed
from convoy.integrations.lightning_checks import check_lightning
from convoy.models.head_loss import check_head_loss_device
from convoy.models.huggingface import HuggingFaceModel, repeated_classes
from convoy.models.lora import check_layout as check_lora_layout
from convoy.models.registry import build_model, check_builds_on_meta, check_model
from convoy.strategies import strategy_class
from convoy.strategies.blocks import compiled_targets, model_blocks
from convoy.tasks import Task, build_task

SAMPLE_ROWS = 2


def preflight(job: Job) -> Job:
    """Check ``job`` against the code and data it names; returns it with ``auto`` settings
    resolved (``checkpoint.best_mode``). Raises ``ConfigError`` on the first problem.

    A ``lightning:`` job brings its own module and data: the task, model and data fields are
    not used, and Lightning's checks (``convoy.integrations.lightning_checks``) run instead.
    """
    job = resolve_tracking(job)
    if job.lightning.enabled:
        check_lightning(job)
        return job
    defer_meta_guards()  # the model is built and run on meta below; nothing compiles here
    task = build_task(job.task.name, job.task.kwargs)
    check_model(job.model.name, job.model.kwargs)
    check_model_device(job)
    check_dataset(job.data)
    splits = load_splits(job.data)
    check_loaded(job.data, splits)
    sample = sample_batch(job, splits)
    check_loader(job, splits, sample)
    check_task_data(job, task, splits)
    job = resolve_best_mode(job, task, splits)
    check_model_fits(job, task, splits, sample)
    check_lora_layout(job.model.lora, tp_size_of(job.strategy))
    check_builds_on_meta(job.model.name, job.model.kwargs, splits.shape, job.model.lora)
    if tp_size_of(job.strategy) > 1:
        check_sequence_split(job, _build(job, splits.shape), sample[0])
    check_memory(job, task, splits, sample)
    if job.run.compile:
        check_compile_mode(job)
        check_compiles(job, task, splits.shape, sample[0])
    return job


def resolve_tracking(job: Job, say: bool = True) -> Job:
    """``job`` with each tracking sink whose library is not installed here switched off, so no
    worker tries it: said in one line (with the install line; unless ``say`` is false) where
    the recipe turned the sink on, quietly where only the default did (TensorBoard is on by
    default where the ``tracking`` extra is installed; ``make run`` installs the core and Ray)."""
    for switch, module_name in TRACKING_SINKS:
        *sections, name = switch.split(".")
        section: Any = job
        for part in sections:
            section = getattr(section, part)
        if not getattr(section, name):
            continue
        sink = importlib.import_module(module_name)
        if installed(sink.PACKAGE):
            continue
        if say and name in section.model_fields_set:
            print(f"convoy: {switch} is on but the sink is off: {sink.MISSING}", file=sys.stderr)
        job = _with_field(job, switch.split("."), False)
    return job


def _with_field(model: Any, path: list[str], value: Any) -> Any:
    """A copy of the pydantic ``model`` with the field at ``path`` set to ``value``."""
    head, *rest = path
    new = _with_field(getattr(model, head), rest, value) if rest else value
    return model.model_copy(update={head: new})


def check_task_data(job: Job, task: Task, splits: Splits) -> None:
    """The data gives what the task needs (its shape keys, labels in range, finite targets)."""
    missing = [key for key in task.required_shape if key not in splits.shape]
    if missing:
        given = ", ".join(splits.shape) or "nothing"
        raise ConfigError(
            "task.name",
            job.task.name,
            f"this task needs shape[{missing[0]!r}] from the data, and data {job.data.name!r} "
            f"gives {given}; pick the task that fits the data, or return "
            f"'shape': {{{missing[0]!r}: ...}} from your data factory",
        )
    try:
        task.check_data(splits)
    except ValueError as exc:
        raise ConfigError("data.name", job.data.name, str(exc)) from None


def resolve_best_mode(job: Job, task: Task, splits: Splits) -> Job:
    """Check ``checkpoint.best_metric`` against what the task reports on this data, and fill
    in ``best_mode: auto``."""
    cfg = job.checkpoint
    allowed = task.rankable(splits.shape, splits.meta)
    if cfg.best_metric not in allowed:
        guess = difflib.get_close_matches(cfg.best_metric, allowed, n=1, cutoff=0.75)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        raise ConfigError(
            "checkpoint.best_metric",
            cfg.best_metric,
            f"{hint}task {job.task.name!r} on data {job.data.name!r} ranks checkpoints by its "
            f"val/ or train/ metrics; {one_of(allowed)}",
        )
    if cfg.best_mode != "auto":
        return job
    checkpoint = cfg.model_copy(update={"best_mode": task.best_mode(cfg.best_metric)})
    return job.model_copy(update={"checkpoint": checkpoint})


def check_loader(job: Job, splits: Splits, sample: tuple[Any, Any]) -> None:
    """A streamed source reads no DataLoader processes; ``data.loader: ray_data`` carries
    samples as tensor columns: inputs and targets must be tensors (inputs may be a dict of
    them: a column each), not tuples."""
    if isinstance(splits.train, ShardedSplit) and job.data.num_workers:
        raise ConfigError(
            "data.num_workers",
            job.data.num_workers,
            f"data {job.data.name!r} is streamed row group by row group, the next window read "
            "in a background thread of each train worker, not by DataLoader processes; "
            "leave it 0",
        )
    if not job.data_from_driver:
        return
    for what, value in zip(("inputs", "targets"), sample, strict=True):
        named = what == "inputs" and isinstance(value, dict)
        columns = value.values() if named else [value]
        if not all(isinstance(column, torch.Tensor) for column in columns):
            raise ConfigError(
                "data.loader",
                "ray_data",
                f"Ray Data carries each sample's inputs (a tensor, or a dict of them) and "
                f"targets as tensor columns; the {what} of {job.data.name!r} are "
                f"{_describe(value)}: use data.loader: torch",
            )


def sample_batch(job: Job, splits: Splits, rows: int = SAMPLE_ROWS) -> tuple[Any, Any]:
    """The first ``rows`` training samples, collated as the DataLoader would."""
    items = [splits.train[i] for i in range(min(rows, len(splits.train)))]
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(
                "data.name",
                job.data.name,
                f"training items must be (inputs, targets) pairs; item 0 is {_describe(item)}",
            )
    inputs, targets = default_collate(items)
    return inputs, targets


def _describe(item: Any) -> str:
    if isinstance(item, (tuple, list)):
        return f"a {type(item).__name__} of {len(item)}"
    return f"a {type(item).__name__}"


def check_model_device(job: Job) -> None:
    """A model setting that cannot run where the job trains (``model.kwargs.head_loss: liger``
    on the CPU), said before the model is built."""
    choice = job.model.kwargs.get("head_loss")
    if not isinstance(choice, str):
        return
    try:
        check_head_loss_device(choice, job.scaling.use_gpu)
    except ValueError as exc:
        where = "this job trains on the CPU (scaling.use_gpu: false)"
        raise ConfigError("model.kwargs.head_loss", choice, f"{where}; {exc}") from None


def check_model_fits(job: Job, task: Task, splits: Splits, sample: tuple[Any, Any]) -> None:
    """Build the model and run it on one batch; its output must fit the task."""
    inputs, targets = sample
    outputs = _forward(job, task, splits.shape, inputs)
    try:
        task.check_output(outputs, targets, splits.shape)
    except ValueError as exc:
        raise ConfigError("model.kwargs", job.model.kwargs, str(exc)) from None
    check_loss(job, task, outputs, targets)


def check_loss(job: Job, task: Task, outputs: Any, targets: Any) -> None:
    """The task's ``loss_sum`` and ``count`` give 0-d tensors on a real batch's shapes."""
    targets = move_to(targets, outputs.device) if isinstance(outputs, torch.Tensor) else targets
    for method in ("loss_sum", "count"):
        try:
            value = task.loss_sum(outputs, targets) if method == "loss_sum" else task.count(targets)
        except Exception as exc:
            raise ConfigError(
                "task.name", job.task.name, f"{method} failed: {type(exc).__name__}: {exc}"
            ) from None
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
            raise ConfigError(
                "task.name",
                job.task.name,
                f"{method} must return a 0-d tensor (a sum over the batch); got {got}",
            )


def _forward(job: Job, task: Task, shape: dict[str, int], inputs: Any) -> Any:
    """The model's outputs on ``inputs``: on the CPU for a small model, else on the meta
    device; on the CPU too for a model that does not run on meta (one that reads values,
    e.g. ``.item()``). A small model that fails on real tensors is tried on meta, whose
    outputs let the task name what does not fit (a vocabulary smaller than the data's)."""
    with torch.device("meta"):
        model = _build(job, shape)
    check_context(job, model, shape)
    failed_on_cpu: Exception | None = None
    if small_enough_to_run(model, inputs):  # larger models stay on meta
        try:
            return _forward_on_cpu(job, task, shape, inputs)
        except ConvoyError:
            raise
        except Exception as exc:
            failed_on_cpu = exc
    try:
        return task.forward(model, move_to(inputs, torch.device("meta")))
    except ConvoyError:
        raise
    except ValueError as exc:  # the model's own complaint (a sequence past its context)
        raise _rejected(job, exc) from None
    except Exception:
        if failed_on_cpu is not None:
            raise _rejected(job, failed_on_cpu) from None
    try:
        return _forward_on_cpu(job, task, shape, inputs)
    except Exception as exc:
        raise _rejected(job, exc) from None


def _forward_on_cpu(job: Job, task: Task, shape: dict[str, int], inputs: Any) -> Any:
    model = _build(job, shape)
    with torch.no_grad():
        return task.forward(model, inputs)


def check_context(job: Job, model: torch.nn.Module, shape: dict[str, int]) -> None:
    """A sequence model's context must hold the data's sequences (``context_length``)."""
    context = getattr(model, "context_length", None)
    seq_len = shape.get("seq_len")
    if isinstance(context, int) and seq_len is not None and seq_len > context:
        raise ConfigError(
            "data.seq_len",
            seq_len,
            f"longer than the context_length {context} of model {job.model.name!r}; lower "
            f"data.seq_len or raise model.kwargs.context_length",
        )


def check_compile_mode(job: Job) -> None:
    """``run.compile: model`` needs a strategy that keeps the model whole, without tensor
    parallelism (whose plan hooks each block's layers)."""
    if job.run.compile != "model":
        return
    if not strategy_class(job.strategy.name).compiles_whole_model or tp_size_of(job.strategy) > 1:
        layout = layout_name(job.strategy.name, tp_size_of(job.strategy))
        raise ConfigError(
            "run.compile",
            "model",
            f"{layout} hooks each block, so it compiles per block: use run.compile: blocks, "
            "or strategy.name single or ddp (without tp_size) for the whole model",
        )


def check_compiles(job: Job, task: Task, shape: dict[str, int], inputs: Any) -> None:
    """``run.compile``: each block's forward must trace as one graph, as the workers compile
    it (``convoy.strategies.blocks``). Traced here with Dynamo's ``eager`` backend (no code
    generation) on the meta device, or on CPU for a model that does not run there; the
    compiler's first error line is the message."""
    import torch._dynamo  # not optional, but 2-3 s to import: only a compiled run pays it

    for device in ("meta", "cpu"):
        with torch.device(device):
            model = _build(job, shape)
        whole = job.run.compile != "model"  # a whole model may break its graph; a block not
        for target in compiled_targets(model, job.run.compile):
            target.forward = torch.compile(target.forward, backend="eager", fullgraph=whole)
        try:
            task.forward(model, move_to(inputs, torch.device(device)))
            return
        except torch._dynamo.exc.TorchDynamoException as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            what = "forward does" if job.run.compile == "model" else "blocks do"
            raise ConfigError(
                "run.compile",
                job.run.compile,
                f"{type(model).__name__}'s {what} not compile as one graph: {first}; "
                "set run.compile: false, or change what the compiler names",
            ) from None
        except Exception:
            continue  # the meta device: try real tensors
        finally:
            torch._dynamo.reset()  # the driver's traces are not the workers'


def check_sequence_split(job: Job, model: torch.nn.Module, inputs: Any) -> None:
    """A plan with sequence parallelism cuts each sequence (dim 1) over the tensor-parallel
    ranks: the data's sequence length must divide evenly."""
    # DTensor's modules take 1-2 s to import: only tensor parallelism pays them.
    from torch.distributed.tensor.parallel import SequenceParallel

    from convoy.strategies.tensor_parallel import model_plan

    tp_size = tp_size_of(job.strategy)
    if not any(isinstance(s, SequenceParallel) for s in model_plan(model, tp_size).values()):
        return
    tokens = next((t.shape[1] for t in tensors_in(inputs) if t.dim() > 1), None)
    if tokens is not None and tokens % tp_size:
        raise ConfigError(
            "strategy.tp_size",
            tp_size,
            f"{type(model).__name__}'s plan cuts each sequence over the tensor-parallel ranks "
            f"(sequence parallelism), and the data's sequences have {tokens} tokens; use a "
            f"sequence length that {tp_size} divides",
        )


@dataclass(frozen=True)
class RankMemory:
    """The memory one rank has here: ``total`` shared by ``ranks`` ranks."""

    total: int
    what: str
    """Where ``total`` comes from (``MemAvailable``, a device's name, ...)."""
    ranks: int = 1

    @property
    def per_rank(self) -> int:
        return self.total // self.ranks

    def describe(self, format_bytes: Any) -> str:
        """``MemAvailable 22.5 GiB / 4 workers on this node``, bytes by ``format_bytes``."""
        shared = f" / {self.ranks} workers on this node" if self.ranks > 1 else ""
        return f"{self.what} {format_bytes(self.total)}{shared}"


PEAK_BYTES_PER_PARAMETER = 48
"""``peak_bound``'s model state: fp32 weights, gradients and accumulated gradients, two
optimizer moments and the step's temporaries, DDP's buckets or FSDP's unsharded units, and a
whole copy while the model is built; the plan's largest moment holds 8 to 10 of these 4."""


def check_memory(
    job: Job, task: Task, splits: Splits, sample: tuple[Any, Any], root: Path = Path("/")
) -> None:
    """Refuse a job whose planned peak per rank (``convoy.plan``: set-up and steps) is over a
    rank's memory here (``rank_memory``; ``root``: where ``/proc`` and ``/sys`` are), in one
    line that names the layouts of its world size that fit (``convoy.plan.fits``); off with
    ``run.skip_memory_check``. A quick upper bound of the peak comes first (``peak_bound``,
    on the meta device), so the planner (its imports, fake tensors: seconds) runs only for
    a job near or over the line; one it cannot plan is let through with a line that says so."""
    memory = None if job.run.skip_memory_check else rank_memory(job, root)
    if memory is None:
        return
    bound = peak_bound(job, task, splits.shape, sample)
    if bound is not None and bound <= memory.per_rank:
        return
    # The planner (1-2 s of imports; its optimizer step loads Dynamo): only near the line.
    from convoy.plan.fits import memory_refusal, plan_world_size
    from convoy.plan.parse import format_bytes

    try:
        plan = plan_world_size(job, splits.shape, sample, memory.per_rank)
    except Exception as exc:  # a model the planner cannot follow: not the user's error
        print(
            f"convoy: memory check skipped: convoy plan failed on model {job.model.name!r} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            file=sys.stderr,
        )
        return
    refusal = memory_refusal(plan, memory.describe(format_bytes))
    if refusal is not None:
        raise ResourceError(refusal)


def rank_memory(job: Job, root: Path = Path("/")) -> RankMemory | None:
    """The memory a rank of ``job`` has: a GPU rank's device memory (that of this machine's
    first GPU, shared by ``scaling.gpus_per_worker`` below 1; None where this machine has
    none: the workers' cannot be known here), a CPU rank's share of this machine's
    (``host_memory``) among the workers on it: ``nproc_per_node`` under torchrun, all of
    them under ``local`` and Ray (the private Ray runs here; see ``run.skip_memory_check``)."""
    scaling = job.scaling
    if scaling.use_gpu:
        if not torch.cuda.is_available():
            return None
        device = torch.cuda.get_device_properties(0)
        share = min(1.0, scaling.gpus_per_worker or 1.0)
        return RankMemory(int(device.total_memory * share), f"{device.name} memory")
    ranks = scaling.launcher_section.workers_per_node(scaling) or scaling.max_workers
    total, what = host_memory(root)
    return RankMemory(total, what, ranks)


def host_memory(root: Path = Path("/")) -> tuple[int, str]:
    """This machine's memory for a job, and what it is: ``MemAvailable`` (what the kernel can
    give without swapping: MemTotal counts what other processes hold, and would pass a job
    that the OOM killer then ends), or the memory limit of this process's cgroup (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``; its own or an ancestor's) where lower."""
    meminfo = (root / "proc/meminfo").read_text()
    kib = next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    available = int(kib) * 1024
    limit = cgroup_memory_limit(root)
    if limit is not None and limit < available:
        return limit, "the container's memory limit"
    return available, "MemAvailable"


def cgroup_memory_limit(root: Path = Path("/")) -> int | None:
    """The lowest memory limit on this process's cgroups and their ancestors (``max`` and
    v1's near-2**63 figure are none), or None."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            limits += _limits_up(root / "sys/fs/cgroup", path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits_up(root / "sys/fs/cgroup/memory", path, "memory.limit_in_bytes")
    return min(limits, default=None)


def _limits_up(base: Path, path: str, name: str) -> list[int]:
    """The limits in the files ``name`` of the cgroup at ``path`` (under ``base``) and of each
    group above it that can be read."""
    parts = PurePosixPath(path).parts[1:]
    limits = []
    for depth in range(len(parts) + 1):
        try:
            text = base.joinpath(*parts[:depth], name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            limits.append(int(text))
    return limits


def peak_bound(job: Job, task: Task, shape: dict[str, int], sample: tuple[Any, Any]) -> int | None:
    """A quick upper bound of the planned peak per rank of any layout of ``job``'s world
    size: ``PEAK_BYTES_PER_PARAMETER`` a parameter, plus 4x what autograd saves on a
    micro-batch (with the batch and the outputs) in fp32, without checkpointing: measured on
    the real ``sample`` rows and scaled for a model small enough to run (its CPU kernels:
    a meta forward would import Dynamo), on the meta device for a larger one. None where the
    model does not run there."""
    with torch.device("meta"):
        skeleton = _build(job, shape)
    params = sum(p.numel() for p in skeleton.parameters())  # a shared parameter counted once
    rows = micro_batch(job, job.scaling.max_workers)
    inputs, targets = sample
    try:
        if small_enough_to_run(skeleton, inputs):
            sample_rows = len(tensors_in(inputs)[0])
            with torch.random.fork_rng(devices=[]):  # the driver's own seed stays as it was
                activations = _saved(task, _build(job, shape), inputs, targets)
            activations = activations * rows // sample_rows
        else:
            activations = _saved(task, skeleton, *(_meta_rows(value, rows) for value in sample))
    except Exception:  # the model reads values meta tensors lack, or fails on real ones
        return None
    return PEAK_BYTES_PER_PARAMETER * params + 4 * activations


def _saved(task: Task, model: torch.nn.Module, inputs: Any, targets: Any) -> int:
    """Bytes of the storages autograd saves in the training forward and loss (parameters and
    buffers left out), with the batch and the outputs."""
    owned = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    saved: dict[Any, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in owned:
            saved[ref] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs, loss = task.forward_loss(model, inputs, targets)
    for tensor in tensors_in((inputs, targets, outputs, loss)):
        saved[StorageWeakRef(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
    return sum(saved.values())


def _meta_rows(value: Any, rows: int) -> Any:
    """``value`` (tensors or nests of them, a batch) with ``rows`` rows, on the meta device."""
    if isinstance(value, torch.Tensor):
        return torch.empty((rows, *value.shape[1:]), dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return {key: _meta_rows(item, rows) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_meta_rows(item, rows) for item in value)
    return value


def _build(job: Job, shape: dict[str, int]) -> torch.nn.Module:
    try:
        model = build_model(job.model.name, job.model.kwargs, shape)
    except ConvoyError:
        raise
    except Exception as exc:  # the user's factory: any failure is reported, not a traceback
        raise ConfigError(
            "model.name", job.model.name, f"the factory raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            "model.name",
            job.model.name,
            f"the factory returned {type(model).__name__}, not a torch.nn.Module",
        )
    check_found_blocks(job, model)
    if job.strategy.activation_checkpointing != "none":
        model_blocks(model, job.strategy.activation_checkpointing)  # it has blocks to checkpoint
    tp_size = tp_size_of(job.strategy)
    if tp_size > 1:
        from convoy.strategies.tensor_parallel import model_plan  # DTensor: 1-2 s to import

        model_plan(model, tp_size)  # it states a plan, and the plan splits evenly
    return model


def check_found_blocks(job: Job, model: torch.nn.Module) -> None:
    """A Hugging Face model that is sharded per block, or checkpointed per block, must have
    its blocks found (``_no_split_modules``, or ``model.kwargs.block_class``). Convoy's own
    and users' models only warn when sharded whole; here the fix is one field away."""
    if not isinstance(model, HuggingFaceModel) or len(model.blocks):
        return
    per_block = strategy_class(job.strategy.name).comm_buffers == "fsdp_units"
    if not per_block and job.strategy.activation_checkpointing == "none":
        return
    inner = type(model.model).__name__
    needs = job.strategy.name if per_block else "activation checkpointing"
    layers = ", ".join(repeated_classes(model.model)) or "none in an nn.ModuleList"
    raise ConfigError(
        "model.kwargs.block_class",
        job.model.kwargs.get("block_class"),
        f"{needs} works per block and {inner}'s blocks are not found (no "
        f"_no_split_modules); set model.kwargs.block_class to the class of its repeated "
        f"layers ({layers})",
    )


def _rejected(job: Job, exc: Exception) -> ConfigError:
    return ConfigError(
        "model.name",
        job.model.name,
        f"the model failed on a batch of data {job.data.name!r}: {type(exc).__name__}: {exc}",
    )
