"""The test suite's CPU budget, in one place: what a test module may cost.

In *reference CPU-s*: CPU seconds (every process a module's tests start, Ray's and the
launchers' included) on the fast sort of CI machine; a run on another machine is scaled by
its calibration (``tests/cpu_budget.py`` says how and why). ``make test`` fails at the end
when a module of that run is over its limit, and ``tests/unit/test_suite_budget.py`` fails
when a module of the committed figures (``tests/suite_cpu_measured.json``) is.

A module over its tier's default is named in ``EXCEPTIONS`` with its own limit and the reason
it needs it; raising a limit is a change a reviewer sees. The limits below were set from the
module table of ``benchmarks/test_suite_cpu_2026-11-28.md`` (measured on the slow sort of
machine, divided by 3, the ratio its section 6 found between the two sorts), about 1.5 times
that: room for run-to-run noise (the session Ray's start lands on whichever module first uses
it on a worker) and for the calibration following a machine's speed only roughly (``import
torch`` is about 2.4 times slower on the slow sort, the suite about 3 times). Once a full
run's figures are committed, ``python tests/cpu_budget.py --headroom`` lists each module's
figure against its limit: set a named module's limit to about 1.5 times its figure, and lower
a limit when a module gets cheaper.
"""

from __future__ import annotations

# The calibration workload's CPU-s (tests/cpu_budget.py, CALIBRATION) on the fast sort of
# machine. Estimated, not yet measured there: the fast sort's `import torch` in a fresh
# interpreter is 1.0-1.25 CPU-s (benchmarks/test_suite_cpu_2026-11-28.md, section 6), and the
# workload's loop about 0.5 more. A full run on a machine of the fast sort prints its own
# calibration; write that figure here if it differs.
REFERENCE_CALIBRATION_CPU_S = 1.8

# Reference CPU-s a module, by tier (the folder under tests/); "other" for a module outside
# the tiers. A unit module stays in its process; a distributed one forks gloo ranks; an e2e or
# cluster one starts launchers, Ray and test hosts (a launch is 15-25 reference CPU-s).
DEFAULTS = {
    "unit": 15.0,
    "distributed": 60.0,
    "e2e": 90.0,
    "cluster": 90.0,
    "gpu": 20.0,
    "other": 20.0,
}

# module -> (its limit in reference CPU-s, why it needs more than its tier's default).
EXCEPTIONS: dict[str, tuple[float, str]] = {
    "tests/distributed/test_strategy_parity.py": (
        90.0,
        "every strategy against single on the same batches, and tensor parallelism composed "
        "with compile and activation checkpointing: Inductor compiles each rank's blocks (one "
        "test is 33 of the module's 36-49 reference CPU-s in the last two full runs)",
    ),
    "tests/unit/test_sft_trl.py": (
        40.0,
        "TRL's own SFTTrainer prepares the rows Convoy's are checked against: trl, accelerate "
        "and datasets are imported once (about 10 CPU-s) and a trainer is built for each of "
        "2 template families x 4 row shapes",
    ),
    "tests/distributed/test_lora.py": (
        120.0,
        "LoRA under every data-parallel layout the issue names (single, ddp x 2, fsdp2 x 2, "
        "hsdp 2 x 2) and an fsdp2 run killed and resumed: six launches, a Llama each",
    ),
    "tests/cluster/test_preemption.py": (
        350.0,
        "spot reclaims on two test hosts: each test starts a Ray head and worker nodes, drains "
        "one mid-epoch and brings a replacement, for ddp and fsdp2 and relaxed collectives",
    ),
    "tests/cluster/test_multinode.py": (
        335.0,
        "the default recipe on a real two-node Ray, compared with one node; an elastic run "
        "that grows; a lost node: several Ray clusters of test hosts",
    ),
    "tests/e2e/test_ray_data.py": (
        270.0,
        "Ray Data pipelines feed Ray Train runs (8 of them): exact sharding, parity with the "
        "torch loader, encoded images, S3 streaming",
    ),
    "tests/e2e/test_shared_machine.py": (
        210.0,
        "many runs on one machine: each command starts its own private Ray (6 of them), a "
        "user-started Ray is joined, a sweep runs beside a run",
    ),
    "tests/e2e/test_fault_tolerance.py": (
        165.0,
        "two worker kills survived bit for bit needs a reference run and three attempts; the "
        "failure budget test needs its own run (audited, benchmarks/test_suite_cpu_2026-11-28.md)",
    ),
    "tests/e2e/test_tune_sweeps.py": (
        125.0,
        "convoy tune on a real Ray: an ASHA sweep of two-worker trials and an interrupted "
        "sweep of two trials, resumed (audited: what the checks need)",
    ),
    "tests/e2e/test_stop_request.py": (
        185.0,
        "each launcher's run stopped by SIGTERM and resumed as a subprocess, against an "
        "uninterrupted reference",
    ),
    "tests/e2e/test_bench_runs.py": (
        170.0,
        "convoy bench all-reduce, scaling and compare through the real launchers: compare "
        "runs every strategy",
    ),
    "tests/e2e/test_launchers.py": (
        130.0,
        "the same recipe under local, torchrun and ray (2 workers each)",
    ),
    "tests/e2e/test_lightning_runs.py": (
        140.0,
        "a LightningModule trained under torchrun and Ray with ddp and fsdp2, then resumed",
    ),
    "tests/e2e/test_task_recipes.py": (
        110.0,
        "the shipped sensor, regression and language-model recipes trained to their bars "
        "under Ray (ddp x 2), the language model exported and evaluated",
    ),
    "tests/unit/test_blocks.py": (
        60.0,
        "torch.compile of each block (Inductor compiles in the test's process) checked to "
        "train as the eager blocks do: the compile is the cost (41 reference CPU-s measured "
        "on 2026-11-28, the unit tier alone)",
    ),
    "tests/distributed/test_hf_parity.py": (
        100.0,
        "Hugging Face llama and GPT-2 from a config under single, ddp, fsdp2, tensor "
        "parallelism and compiled, checkpointed blocks, each on its own 2-rank gloo launch "
        "(52.5 reference CPU-s on the 2026-11-28 full run)",
    ),
    "tests/distributed/test_task_parity.py": (
        100.0,
        "every task's losses under single vs ddp vs fsdp2 vs tensor parallel (compiled and "
        "checkpointed too) on the same global batch: a 2-rank gloo launch per layout "
        "(50.3 reference CPU-s on the 2026-11-28 full run)",
    ),
    "tests/distributed/test_plan_check.py": (
        100.0,
        "convoy plan --check against torch's memory trackers on real strategy wrappers, over "
        "fake process groups of 1, 2 and 4 ranks",
    ),
}
