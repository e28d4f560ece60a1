"""The GPU checklist in one run: CUDA tests, ViT bf16 vs fp32, gpt_small under fsdp2, plan vs
measured memory, and ``convoy bench compare``. Prints a short table last.

    python3 benchmarks/gpu_checklist.py --out "$OUT"          # on a CUDA machine
    python3 benchmarks/gpu_checklist.py --out /tmp/x --quick  # CPU dry run of every command
    python3 benchmarks/gpu_checklist.py --out "$OUT" --after-fixes  # the fixes' checks
    python3 benchmarks/gpu_checklist.py --out "$OUT" --extras  # bf16 vs fp32 extras only

Every step is a subprocess of ``python -m convoy`` (or pytest) with its own time limit; a step
that fails is recorded (exit code and the last lines of its output) and the rest still run.
What comes back under ``--out``: ``checklist.log`` (every command and its whole output),
``results.json`` (the figures), ``table.md`` (the table printed last) and ``runs.tar.gz``
(each run's config.yaml, summary.json and metrics.jsonl).

The steps, most important first; a global deadline skips what no longer fits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(os.environ.get("CONVOY_TREE") or Path(__file__).resolve().parents[1]).resolve()
"""The Convoy tree to run (src/, tests/, recipes/, pyproject.toml): this checkout, or a clean
export of a commit named by ``CONVOY_TREE`` (``git archive HEAD | tar -x -C DIR``)."""
VIT = "recipes/course_vit_synthetic.yaml"
LM = "recipes/lm_tiny.yaml"

# gpt_small (124 M, GPT-2's 50,304-token vocabulary) on the bundled pydoc text as UTF-8 bytes
# (no tokenizer training), 1,024-token sequences, 16 per step: 16,384 tokens per step.
GPT_SMALL = [
    "task.name=language_modeling",
    "model.name=gpt_small",
    "model.kwargs.vocab_size=50304",
    "model.kwargs.dropout=0.0",
    "data.name=text",
    "data.tokenizer=bytes",
    "data.seq_len=1024",
    "data.batch_size=16",
    "data.eval_batch_size=16",
    "optim.lr=6e-4",
    "optim.warmup_steps=5",
    "strategy.name=fsdp2",
    "scaling.launcher=torchrun",
    "scaling.num_workers=1",
    "run.epochs=100",
    "run.eval_every_epochs=100",
    "checkpoint.every_epochs=null",
]


class Checklist:
    def __init__(self, out: Path, quick: bool, deadline_s: float) -> None:
        self.out = out
        self.quick = quick
        # Outside ``out``: the run folders hold many files; only the tarball goes into ``out``.
        self.runs = Path(tempfile.mkdtemp(prefix="convoy-gpu-checklist-"))
        self.log = (out / "checklist.log").open("w")
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s
        self.results: dict[str, Any] = {"steps": {}}

    @staticmethod
    def env(tree: Path) -> dict[str, str]:
        """The environment that runs ``tree``'s Convoy (its src/ first on the path)."""
        paths = [str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        return dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            CONVOY_TREE=str(tree),
            PYTHONPATH=os.pathsep.join(paths),
        )

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(
        self, key: str, cmd: list[str], limit_s: float, tree: Path = REPO
    ) -> tuple[int | None, str]:
        """Run ``cmd``; record its exit code, seconds and last lines; return (rc, output)."""
        limit = min(limit_s, self.left())
        if limit < 20:
            self.results["steps"][key] = {"rc": None, "skipped": "deadline"}
            self._write(f"\n### {key}: skipped (deadline)\n")
            return None, ""
        self._write(f"\n### {key} (limit {limit:.0f} s)\n$ {shlex.join(cmd)}\n")
        began = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=tree, env=self.env(tree), capture_output=True, text=True, timeout=limit
            )
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except FileNotFoundError as exc:
            rc, text = 127, str(exc)
        except subprocess.TimeoutExpired as exc:
            rc = 124
            text = _text(exc.stdout) + _text(exc.stderr) + f"\n[timed out after {limit:.0f} s]"
        seconds = time.monotonic() - began
        self._write(text + f"\n[rc {rc}, {seconds:.1f} s]\n")
        tail = text.strip().splitlines()[-25:]
        self.results["steps"][key] = {"rc": rc, "seconds": round(seconds, 1), "tail": tail}
        print(
            f"[{time.monotonic() - self.start:6.0f} s] {key}: rc {rc} in {seconds:.1f} s",
            flush=True,
        )
        return rc, text

    def convoy(
        self, key: str, args: list[str], limit_s: float, tree: Path = REPO
    ) -> tuple[int | None, str]:
        return self.run(key, [sys.executable, "-m", "convoy", *args], limit_s, tree)

    def train(
        self,
        key: str,
        recipe: str,
        overrides: list[str],
        limit_s: float,
        global_batch: int | None = None,
    ) -> dict | None:
        """``convoy train``; returns the run's summary.json, or None. With ``global_batch``,
        the picked summary also has the steady-state rate and MFU (from the median step)."""
        base = [f"run.storage_dir={self.runs}", f"run.name={key}", "run.progress=plain"]
        use_gpu = "false" if self.quick else "true"
        args = ["train", recipe]
        for item in [*overrides, f"scaling.use_gpu={use_gpu}", *base]:
            args += ["-o", item]
        self.convoy(key, args, limit_s)
        path = self.runs / key / "summary.json"
        if not path.is_file():
            return None
        summary = json.loads(path.read_text())
        if global_batch:
            summary["_global_batch"] = global_batch
        self.results["steps"][key]["summary"] = pick(summary)
        return summary

    def plan(self, key: str, overrides: list[str], train_key: str) -> None:
        """``convoy plan --check`` for fsdp2 x 1 with ``overrides``, recorded beside the
        training run ``train_key`` of the same layout (its measured peak)."""
        args = ["plan", LM, "--strategies", "fsdp2", "--world-sizes", "1", "--check", "--json",
                "--gpu-memory", "80GiB"]  # fmt: skip
        for item in overrides:
            args += ["-o", item]
        rc, text = self.convoy(key, args, 120)
        if rc == 0:
            with contextlib.suppress(ValueError):
                found = json.loads(text[text.index("{") : text.rindex("}") + 1])
                self.results.setdefault("plans", {})[key] = {"train": train_key, "plan": found}

    def _write(self, text: str) -> None:
        self.log.write(text)
        self.log.flush()


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


SUMMARY_KEYS = (
    "strategy", "launcher", "world_size", "precision", "steps", "device_name",
    "samples_per_second", "tokens_per_second", "step_seconds_median", "step_seconds_p10",
    "step_seconds_p90", "train_seconds", "wall_seconds", "flops_per_sample",
    "tflops_per_second", "peak_flops_per_device", "mfu", "data_wait_fraction",
    "first_batch_seconds", "data_wait_fraction_after_first",
    "peak_memory_bytes_per_rank", "peak_memory_reserved_bytes_per_rank", "compile_seconds",
    "metrics",
)  # fmt: skip


def pick(summary: dict[str, Any]) -> dict[str, Any]:
    picked = {k: summary.get(k) for k in SUMMARY_KEYS if k in summary}
    # Steady state from the median step (the summary's rates include the first, slow steps).
    step, flops = summary.get("step_seconds_median"), summary.get("flops_per_sample")
    batch = summary.get("_global_batch")
    if step and batch:
        picked["samples_per_second_steady"] = batch / step
        if flops and summary.get("peak_flops_per_device"):
            picked["mfu_steady"] = flops * batch / step / summary["peak_flops_per_device"]
    return picked


# ---------------------------------------------------------------------------------------------
# The probe: which dtype each strategy really computes in, and the matmul ceilings.


def probe() -> dict[str, Any]:
    """Run one forward of vit_course as the engine builds it (strategy.wrap + Precision) and
    record the dtypes a Linear sees; time bf16 / fp32 / tf32 matmuls for the ceilings."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from convoy.config import load_job
    from convoy.engine.amp import Precision
    from convoy.models.registry import build_model
    from convoy.strategies import build_strategy
    from convoy.strategies.base import dtype_from_name

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "dtypes": {},
    }
    if cuda:
        _free, total = torch.cuda.mem_get_info()
        out["memory_total_bytes"] = total
        out["capability"] = list(torch.cuda.get_device_capability(0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    shape = {"num_classes": 10, "in_channels": 3, "image_size": 32}
    for strat in ("single", "ddp", "fsdp2"):
        for prec in ("bf16", "fp32"):
            key = f"{strat}/{prec}"
            try:
                job = load_job(
                    REPO / VIT,
                    [f"strategy={{name: {strat}}}", f"precision={prec}", "scaling.num_workers=1"],
                )
                strategy = build_strategy(job.strategy, dev, dtype_from_name(prec))
                torch.manual_seed(0)
                model = build_model(job.model.name, job.model.kwargs, shape)
                linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
                seen: dict[str, str] = {}

                def hook(mod, args, result, seen=seen):  # type: ignore[no-untyped-def]
                    seen["linear_in"] = str(args[0].dtype)
                    seen["linear_weight"] = str(mod.weight.dtype)
                    seen["linear_out"] = str(result.dtype)

                linear.register_forward_hook(hook)
                wrapped = strategy.wrap(model)
                precision = Precision(dtype_from_name(prec), dev, strategy)
                images = torch.randn(8, 3, 32, 32, device=dev)
                with precision.autocast():
                    logits = wrapped(images)
                    loss = nn.functional.cross_entropy(
                        logits, torch.zeros(8, dtype=torch.long, device=dev)
                    )
                loss.backward()
                seen["logits"] = str(logits.dtype)
                seen["autocast"] = str(precision.use_autocast)
                out["dtypes"][key] = seen
            except Exception as exc:  # recorded, the probe goes on
                out["dtypes"][key] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.destroy_process_group()
    if cuda:
        out["matmul_tflops"] = _matmul_ceilings(torch)
    return out


def _matmul_ceilings(torch: Any) -> dict[str, float]:
    n, rates = 8192, {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                              ("tf32", torch.float32, True)):  # fmt: skip
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 10 if dtype == torch.bfloat16 or tf32 else 3
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        rates[name] = 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    return rates


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-checklist-out"))
    parser.add_argument("--quick", action="store_true", help="tiny CPU sizes: check the commands")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds for everything")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--followup",
        metavar="FIXED_TREE",
        help="run the follow-up part: proposed fixes in a patched copy of the tree",
    )
    parser.add_argument(
        "--after-fixes",
        action="store_true",
        help="run the checks of the fixes (plan, fsdp2 on CPU and GPU, bench compare, tests)",
    )
    parser.add_argument(
        "--extras",
        action="store_true",
        help="only the bf16-vs-fp32 extras (ViT at batch 1024, gpt_small fp32) with their "
        "baselines, for a second call when the first one's deadline skipped them",
    )
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe()))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = Checklist(out, args.quick, args.deadline)
    if args.followup:
        followup(c, Path(args.followup).resolve())
    elif args.after_fixes:
        after_fixes(c)
    elif args.extras:
        precision_extras(c, baselines=True)
    else:
        checklist(c)
    (out / "results.json").write_text(json.dumps(c.results, indent=2, default=str))
    table = format_table(c.results)
    (out / "table.md").write_text(table + "\n")
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for path in sorted(c.runs.rglob("*")):
            if path.is_file() and path.name in ("summary.json", "config.yaml", "metrics.jsonl"):
                tar.add(path, arcname=str(path.relative_to(c.runs)))
    c.log.close()
    print(table)
    return 0


def checklist(c: Checklist) -> None:
    """The checklist on ``REPO``: items 2-4 first (the measurements), then the CUDA tests
    (item 1), then item 5's extras (fp32 LM, ViT at a batch that fills the GPU, the recipe's own
    fsdp2 under torchrun, torch.compile and activation checkpointing on CUDA). The global
    deadline skips whatever no longer fits, so the most important steps come first."""
    quick = c.quick
    py = sys.executable
    use_gpu = "false" if quick else "true"

    # 0. The machine and the dtype probe.
    c.run("nvidia-smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                         "clocks.max.sm,power.limit", "--format=csv"], 30)  # fmt: skip
    c.results["tree"] = str(REPO)
    commit = REPO / "COMMIT"
    c.results["commit"] = os.environ.get("CONVOY_COMMIT") or (
        commit.read_text().strip() if commit.is_file() else None
    )
    rc, text = c.run("probe", [py, str(Path(__file__).resolve()), "--probe"], 120)
    found = [line for line in text.splitlines() if line.startswith('{"torch"')]
    if rc == 0 and found:
        c.results["probe"] = json.loads(found[-1])

    # 2. vit_course on synthetic CIFAR-shaped data: single / ddp on local, bf16 / fp32.
    vit_size = ["data.train_size=512", "data.batch_size=32", "model.kwargs.depth=1"]
    vit_size = vit_size if quick else []
    vit_batch = 32 if quick else 128
    vit_steps = f"run.max_steps={6 if quick else 60}"
    for strat in ("single", "ddp"):
        for prec in ("bf16", "fp32"):
            key = f"vit_{strat}_{prec}"
            overrides = [f"strategy={{name: {strat}}}", f"precision={prec}", vit_steps,
                         "scaling.launcher=local", "scaling.num_workers=1", *vit_size]  # fmt: skip
            c.train(key, VIT, overrides, 120, vit_batch)

    # 3. gpt_small, fsdp2, world 1 under torchrun: tokens/s, MFU, peak memory; then the plan.
    gpt = [*GPT_SMALL, f"run.max_steps={4 if quick else 30}"]
    if quick:
        gpt += ["model.name=gpt_tiny", "model.kwargs.vocab_size=512", "data.seq_len=128"]
    c.train("gpt_small_fsdp2_bf16", LM, [*gpt, "precision=bf16"], 150, 16)
    c.plan("plan_check_gpt_small_fsdp2_bf16", [*gpt, "precision=bf16"], "gpt_small_fsdp2_bf16")

    # 4. bench compare on the ViT recipe as it is (fsdp2's options stay with fsdp2): single,
    # ddp, fsdp2 at world 1, bf16, local launcher.
    compare = ["bench", "compare", VIT, "--strategies", "single,ddp,fsdp2", "--workers", "1",
               "--steps", "3" if quick else "20", "--warmup", "2" if quick else "5",
               "--out", str(c.runs / "bench")]  # fmt: skip
    for item in ["scaling.launcher=local", "scaling.num_workers=1", f"scaling.use_gpu={use_gpu}",
                 *vit_size]:  # fmt: skip
        compare += ["-o", item]
    rc, text = c.convoy("bench_compare_vit", compare, 150)
    c.results["compare_text"] = text.strip().splitlines()[-14:] if rc == 0 else None

    # 1. The CUDA tests (after the measurements: they take the longest and passed before).
    c.run("pytest_gpu", [py, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"], 180)
    c.run("pytest_gpu_marked_collect", [py, "-m", "pytest", "tests", "-m", "gpu", "--co", "-q",
                                        "-p", "no:cacheprovider"], 60)  # fmt: skip

    # 5. Extras, as long as the deadline allows, the ones never run on a GPU first:
    # torch.compile (Inductor on CUDA) and activation checkpointing under fsdp2, bf16.
    c.train("gpt_small_fsdp2_bf16_compile", LM, [*gpt, "precision=bf16", "run.compile=true"],
            180, 16)  # fmt: skip
    ac = [*gpt, "precision=bf16", "strategy.activation_checkpointing=full"]
    c.train("gpt_small_fsdp2_bf16_ac", LM, ac, 120, 16)
    c.plan("plan_check_gpt_small_fsdp2_bf16_ac", ac, "gpt_small_fsdp2_bf16_ac")
    precision_extras(c, baselines=False)


def precision_extras(c: Checklist, baselines: bool) -> None:
    """bf16 against fp32 where the GPU, not the host, sets the pace: ViT at batch 1024 and
    gpt_small in fp32 (under ``--extras`` with the batch-128 ViT and bf16 gpt_small runs
    again, so each comparison is on one machine), then the recipe's own fsdp2 under torchrun."""
    quick = c.quick
    vit_size = ["data.train_size=512", "data.batch_size=32", "model.kwargs.depth=1"]
    vit_size = vit_size if quick else []
    vit_batch = 32 if quick else 128
    vit_steps = f"run.max_steps={6 if quick else 60}"
    gpt = [*GPT_SMALL, f"run.max_steps={4 if quick else 30}"]
    if quick:
        gpt += ["model.name=gpt_tiny", "model.kwargs.vocab_size=512", "data.seq_len=128"]
    if baselines:
        c.run("nvidia-smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                             "power.limit", "--format=csv"], 30)  # fmt: skip
    # ViT at a batch that fills the GPU (the recipe's 128 is bound by the host).
    big = ["data.batch_size=64", "data.train_size=1024"] if quick else [
        "data.batch_size=1024", "data.train_size=40960", "data.eval_batch_size=1024"]  # fmt: skip
    big_batch = 64 if quick else 1024
    for prec in ("bf16", "fp32"):
        overrides = ["strategy={name: single}", f"precision={prec}", "scaling.launcher=local",
                     "scaling.num_workers=1", "run.max_steps=" + ("4" if quick else "25"),
                     "run.epochs=1", *big, *vit_size[2:]]  # fmt: skip
        c.train(f"vit_single_{prec}_batch{big_batch}", VIT, overrides, 120, big_batch)
    if baselines:
        for prec in ("bf16", "fp32"):
            overrides = ["strategy={name: single}", f"precision={prec}", vit_steps,
                         "scaling.launcher=local", "scaling.num_workers=1", *vit_size]  # fmt: skip
            c.train(f"vit_single_{prec}", VIT, overrides, 120, vit_batch)
    c.train("gpt_small_fsdp2_fp32", LM, [*gpt, "precision=fp32", "run.max_steps=" +
                                         ("4" if quick else "15")], 120, 16)  # fmt: skip
    if baselines:
        c.train("gpt_small_fsdp2_bf16", LM, [*gpt, "precision=bf16"], 150, 16)
    # The recipe's own strategy (fsdp2, bf16) under torchrun, world 1.
    c.train("vit_fsdp2_bf16_torchrun", VIT, ["scaling.num_workers=1", vit_steps, *vit_size],
            120, vit_batch)  # fmt: skip


def followup(c: Checklist, fixed: Path) -> None:
    """After the checklist: the proposed src fixes (a patched copy of the tree at ``fixed``)
    against ``REPO`` as it is, the GPU tests, and ViT bf16 vs fp32 at a batch that fills the
    GPU (the recipe's batch of 128 is bound by the host)."""
    quick = c.quick
    use_gpu = "false" if quick else "true"
    gpt = [*GPT_SMALL, "precision=bf16"]
    gpt += (
        [
            "run.max_steps=4",
            "model.name=gpt_tiny",
            "data.seq_len=128",
            "model.kwargs.vocab_size=512",
        ]
        if quick
        else []
    )
    gpt += [] if quick else ["run.max_steps=40"]
    plan = ["plan", LM, "--strategies", "fsdp2", "--world-sizes", "1", "--check", "--json",
            "--gpu-memory", "80GiB"]  # fmt: skip
    for item in gpt:
        plan += ["-o", item]
    rc, text = c.convoy("plan_check_gpt_small_fsdp2_bf16_fixed", plan, 150, fixed)
    if rc == 0:
        with contextlib.suppress(ValueError):
            c.results["plan"] = json.loads(text[text.index("{") : text.rindex("}") + 1])
    # fsdp2 on the CPU of a machine that has a GPU: as is, then with the mesh fix.
    cpu_fsdp2 = ["train", "recipes/default.yaml"]
    for item in ["strategy.name=fsdp2", "scaling.launcher=local", "scaling.num_workers=1",
                 "scaling.use_gpu=false", "run.max_steps=3", "run.epochs=1", "run.progress=off",
                 "checkpoint.every_epochs=null", f"run.storage_dir={c.runs}"]:  # fmt: skip
        cpu_fsdp2 += ["-o", item]
    c.convoy("fsdp2_cpu_on_gpu_host_as_is", cpu_fsdp2, 90)
    c.convoy("fsdp2_cpu_on_gpu_host_fixed", cpu_fsdp2, 90, fixed)
    c.run("pytest_gpu", [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p",
                         "no:cacheprovider"], 240)  # fmt: skip
    key = "gpt_small_fsdp2_bf16"  # on the fixed tree: the measurement beside the plan
    runs = [f"run.storage_dir={c.runs}", f"run.name={key}", "run.progress=plain"]
    args = ["train", LM]
    for item in [*gpt, f"scaling.use_gpu={use_gpu}", *runs]:
        args += ["-o", item]
    c.convoy(key, args, 200, fixed)
    summary_path = c.runs / key / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        summary["_global_batch"] = 16
        c.results["steps"][key]["summary"] = pick(summary)
    big = ["data.batch_size=64", "data.train_size=1024", "model.kwargs.depth=1"] if quick else [
        "data.batch_size=1024", "data.train_size=40960", "data.eval_batch_size=1024"]  # fmt: skip
    for prec in ("bf16", "fp32"):
        key = f"vit_single_{prec}_batch{1024 if not quick else 64}"
        overrides = ["strategy={name: single}", f"precision={prec}", "scaling.launcher=local",
                     "scaling.num_workers=1", "run.max_steps=30", "run.epochs=1", *big]  # fmt: skip
        summary = c.train(key, VIT, overrides, 150)
        if summary:
            summary["_global_batch"] = 64 if quick else 1024
            c.results["steps"][key]["summary"] = pick(summary)


def after_fixes(c: Checklist) -> None:
    """The fixes on ``REPO``: ``convoy plan`` for fsdp2 with and without ``--check``, fsdp2
    with ``scaling.use_gpu=false`` on the GPU machine, gpt_small under fsdp2 on the GPU (the
    measurement beside the plan), ``bench compare`` on the ViT recipe as it is (its fsdp2
    options kept from single and ddp), then the CUDA tests. Most important first."""
    quick = c.quick
    steps = 4 if quick else 20
    gpt = [*GPT_SMALL, "precision=bf16", f"run.max_steps={steps}"]
    if quick:
        gpt += ["model.name=gpt_tiny", "model.kwargs.vocab_size=512", "data.seq_len=128"]
    for check in (False, True):
        plan = ["plan", LM, "--strategies", "fsdp2", "--world-sizes", "1", "--json",
                "--gpu-memory", "80GiB", *(["--check"] if check else [])]  # fmt: skip
        for item in gpt:
            plan += ["-o", item]
        key = "plan_check_gpt_small_fsdp2_bf16" if check else "plan_gpt_small_fsdp2_bf16"
        rc, text = c.convoy(key, plan, 150 if check else 60)
        if rc == 0 and check:
            with contextlib.suppress(ValueError):
                c.results["plan"] = json.loads(text[text.index("{") : text.rindex("}") + 1])
    # fsdp2 on the CPU of a machine that has a GPU.
    key = "fsdp2_cpu_on_gpu_host"
    cpu_fsdp2 = ["train", "recipes/default.yaml"]
    for item in ["strategy.name=fsdp2", "scaling.launcher=local", "scaling.num_workers=1",
                 "scaling.use_gpu=false", "run.max_steps=3", "run.epochs=1", "run.progress=plain",
                 "checkpoint.every_epochs=null", f"run.storage_dir={c.runs}",
                 f"run.name={key}"]:  # fmt: skip
        cpu_fsdp2 += ["-o", item]
    c.convoy(key, cpu_fsdp2, 90)
    path = c.runs / key / "summary.json"
    if path.is_file():
        c.results["steps"][key]["summary"] = pick(json.loads(path.read_text()))
    key = "gpt_small_fsdp2_bf16"
    summary = c.train(key, LM, gpt, 150)
    if summary:
        summary["_global_batch"] = 16
        c.results["steps"][key]["summary"] = pick(summary)
    vit_size = ["data.train_size=512", "data.batch_size=32", "model.kwargs.depth=1"]
    compare = ["bench", "compare", VIT, "--strategies", "single,ddp,fsdp2", "--workers", "1",
               "--steps", "3" if quick else "20", "--warmup", "2" if quick else "5",
               "--out", str(c.runs / "bench")]  # fmt: skip
    for item in ["scaling.launcher=local", "scaling.num_workers=1",
                 f"scaling.use_gpu={'false' if quick else 'true'}",
                 *(vit_size if quick else [])]:  # fmt: skip
        compare += ["-o", item]
    rc, text = c.convoy("bench_compare_vit", compare, 180)
    c.results["compare_text"] = text.strip().splitlines()[-14:] if rc == 0 else None
    if not quick:
        c.run("pytest_gpu", [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p",
                             "no:cacheprovider"], 180)  # fmt: skip


def format_table(results: dict[str, Any]) -> str:
    lines = ["| step | rc | s |", "|---|---|---|"]
    for key, step in results["steps"].items():
        lines.append(f"| {key} | {step.get('rc')} | {step.get('seconds', '-')} |")
    lines += ["", "| run | prec | img or tok/s (summary) | steady /s | step ms (median) | MFU (summary) "
              "| MFU (steady) | peak alloc MiB | peak reserved MiB | compile s |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, step in results["steps"].items():
        s = step.get("summary")
        if not s:
            continue
        rate = s.get("tokens_per_second") or s.get("samples_per_second")
        steady = s.get("samples_per_second_steady")
        if s.get("tokens_per_second") and steady:
            steady *= s["tokens_per_second"] / s["samples_per_second"]
        mem = (s.get("peak_memory_bytes_per_rank") or [0])[0] / 2**20
        res = (s.get("peak_memory_reserved_bytes_per_rank") or [0])[0] / 2**20
        lines.append(
            f"| {key} | {s.get('precision')} | {_num(rate)} | {_num(steady)} | "
            f"{_num((s.get('step_seconds_median') or 0) * 1e3, 2)} | {_pct(s.get('mfu'))} | "
            f"{_pct(s.get('mfu_steady'))} | {mem:,.0f} | {res:,.0f} | "
            f"{_num(s.get('compile_seconds'), 1)} |"
        )
    probe_ = results.get("probe") or {}
    if probe_:
        lines += ["", f"device {probe_.get('device')}, torch {probe_.get('torch')}, "
                  f"matmul TFLOP/s {probe_.get('matmul_tflops')}"]  # fmt: skip
        for key, seen in probe_.get("dtypes", {}).items():
            lines.append(f"dtype {key}: {seen}")
    plans = dict(results.get("plans") or {})
    if results.get("plan"):  # the follow-up and after-fixes parts record one plan
        plans["plan"] = {"train": "gpt_small_fsdp2_bf16", "plan": results["plan"]}
    for key, item in plans.items():
        plan = item["plan"]
        gpt = (results["steps"].get(item["train"]) or {}).get("summary")
        if not plan.get("layouts"):
            continue
        planned = plan["layouts"][0]["peak"]
        tracked = (plan.get("check") or [{}])[0].get("tracked_peak")
        if isinstance(tracked, dict):  # FSDPMemTracker's categories and their "Total"
            tracked = tracked.get("Total")
        line = f"{key}: planned peak {planned / 2**20:,.0f} MiB, tracked " + (
            "-" if tracked is None else f"{tracked / 2**20:,.0f} MiB"
        )
        if gpt and gpt.get("peak_memory_bytes_per_rank"):
            measured = gpt["peak_memory_bytes_per_rank"][0]
            line += (
                f", measured max_memory_allocated {measured / 2**20:,.0f} MiB "
                f"({item['train']}); planned / measured = {planned / measured:.3f}"
            )
        lines += ["", line]
    for line in results.get("compare_text") or []:
        lines.append(line)
    return "\n".join(lines)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    raise SystemExit(main())
