"""A launch imports what its job uses: the modules a worker holds after its first step.

Every process a run starts pays its imports: each train worker, each restart, each sweep
trial. A ``digits_mlp`` worker needs torch, Convoy and its data; it must not load a plotting
library, transformers, scipy or torchmetrics (``import torchmetrics`` alone loads the three
where they are installed, as here: every extra is installed for the tests), nor scikit-learn
(the dataset is read from its cache), nor torch._dynamo (1.5-2 CPU-s): nothing compiles.
Under ``ddp`` torch would import it (``DistributedDataParallel.__init__`` reads a Dynamo
setting and its forward takes a Dynamo guard, torch 2.13); ``convoy.dynamo_guard`` answers
both while Dynamo is not loaded. (FSDP2's DTensor still imports it.) sympy is allowed:
torch.distributed.checkpoint, which writes the job's checkpoints, imports it with DTensor.

The workers are real: ``convoy train`` on ``local`` and on ``torchrun`` x 2, each command a
fresh interpreter, not the test process. torchrun's workers are forked from the fork server
that command starts, so they hold what it preloads (``convoy.fork_server.PRELOAD``) too. A
``sitecustomize`` on ``PYTHONPATH`` has each worker write ``sys.modules`` when its first train
step (forward, backward, optimizer) is done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "digits_mlp.yaml"

NEVER = ("matplotlib", "transformers", "scipy", "torchmetrics", "sklearn")
"""Module families no digits_mlp worker loads (once the machine's dataset cache holds digits:
a miss decodes it once with scikit-learn)."""
DYNAMO = ("torch._dynamo",)

# Wraps the engine's train step as the loop module is imported: the first call, once done,
# writes the worker's modules to $CONVOY_TEST_MODULES/<pid>.json.
SITECUSTOMIZE = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, os, sys

    class _WrapTrainStep(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "convoy.engine.loop":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                step = module.train_step

                def first_step_writes_modules(*args, **kwargs):
                    result = step(*args, **kwargs)
                    if not getattr(first_step_writes_modules, "written", False):
                        first_step_writes_modules.written = True
                        out = os.path.join(os.environ["CONVOY_TEST_MODULES"], f"{os.getpid()}.json")
                        with open(out, "w") as f:
                            json.dump(sorted(sys.modules), f)
                    return result

                module.train_step = first_step_writes_modules

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _WrapTrainStep())
    """
)


@pytest.fixture(scope="module", autouse=True)
def digits_in_the_cache() -> None:
    """The dataset decoded into the machine's cache (the tests' CONVOY_CACHE_DIR) first, as
    after a machine's first run."""
    from convoy.config import load_job
    from convoy.data.registry import load_splits

    load_splits(load_job(RECIPE).data)


def worker_modules(tmp_path: Path, *overrides: str) -> list[set[str]]:
    """``convoy train`` digits_mlp for two steps; each worker's modules once its first step is done."""
    hook, out = tmp_path / "hook", tmp_path / "modules"
    hook.mkdir()
    out.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, CONVOY_TEST_MODULES=str(out))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "convoy", "train", str(RECIPE)]
    for override in (
        f"run.storage_dir={tmp_path / 'runs'}",
        "run.max_steps=2",
        "run.epochs=1",
        "run.progress=plain",
        *overrides,
    ):
        command += ["-o", override]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return [set(json.loads(path.read_text())) for path in sorted(out.glob("*.json"))]


def loaded(modules: set[str], families: tuple[str, ...]) -> list[str]:
    return sorted(f for f in families if any(m == f or m.startswith(f + ".") for m in modules))


def test_a_single_worker_loads_no_plotting_text_scipy_metrics_or_dynamo(tmp_path: Path) -> None:
    (modules,) = worker_modules(
        tmp_path, "strategy.name=single", "scaling.launcher=local", "scaling.num_workers=1"
    )
    assert "convoy.engine.loop" in modules and "torch" in modules  # the hook saw a worker
    assert loaded(modules, NEVER + DYNAMO) == []


def test_ddp_workers_under_torchrun_load_no_plotting_text_scipy_metrics_or_dynamo(
    tmp_path: Path,
) -> None:
    workers = worker_modules(
        tmp_path, "strategy.name=ddp", "scaling.launcher=torchrun", "scaling.num_workers=2"
    )
    assert len(workers) == 2
    for modules in workers:
        assert "torch.nn.parallel.distributed" in modules
        assert loaded(modules, NEVER + DYNAMO) == []
