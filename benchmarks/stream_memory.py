"""Memory of a streamed dataset as it grows: peak RSS of one training worker over a whole
epoch of the telematics fleet at 1x and 10x the rows, read from a local folder and from an
S3-compatible server, with the worker held under a memory cap smaller than the data.

``--workloads text`` does the same for a streamed text corpus (``data.name: text`` over
``train/ val/ test/`` shards: the pydoc topics copied N times, each copy numbered; val and
test of fixed size): ``recipes/lm_tiny.yaml`` with the bytes tokenizer, the counting pass
over every train row group, ``--text-steps`` training steps and the whole val and test, from
a local folder.

Each run is ``convoy train recipes/telematics_stream.yaml`` on the ``local`` launcher (one
process: the worker is the process the cap holds), strategy ``single``, a small conv1d so the
epoch is quick, inside a cgroup-v1 memory cgroup whose ``memory.limit_in_bytes`` is
``--cap-mib`` (the kernel kills the process, not swaps it, when it would go over). Reported:
the data's size, the peak RSS the run's summary gives (``VmHWM``; shared libraries count in
it but are charged to the cgroup that first read them), the cgroup's own peak (which counts
the page cache the kernel reclaims under the cap) and how often the cap was reached
(``memory.failcnt``: reclaim, not a kill), samples/s and wall time.
The S3 server is the tests' moto server on loopback (``tests/s3server.py``).

Needs root (cgroup v1 at /sys/fs/cgroup/memory) and about 2.5x the largest size in disk.

    python benchmarks/stream_memory.py [--base-devices 64] [--cap-mib 768] [--out benchmarks/]
    python benchmarks/stream_memory.py --workloads text --sources local [--base-copies 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
CONVOY = [sys.executable, "-m", "convoy"]
MODEL = "model={name: conv1d, kwargs: {hidden: 16, depth: 2}}"
TELEMATICS = "telematics_stream.yaml"
LM = "lm_tiny.yaml"


def write_fleet(out: str, devices: int, env: dict[str, str]) -> dict[str, Any]:
    command = [*CONVOY, "data", "synth-telematics", out, "--devices", str(devices), "--hours", "1"]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    written = subprocess.run(
        [sys.executable, "-c", _READ_SUMMARY, out],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(written.stdout))


_READ_SUMMARY = """
import sys
from convoy.data.shards import join, open_location
fs, root = open_location(sys.argv[1])
with fs.open_input_stream(join(root, "series.json")) as stream:
    print(stream.read().decode())
"""


def write_corpus(out: Path, copies: int) -> dict[str, Any]:
    """Text shards of the pydoc topics, ``copies`` numbered copies in train (row groups of
    256 documents, shards of 64 groups); val and test: 16 documents each, whatever ``copies``."""
    from pydoc_data.topics import topics

    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(topics)
    held = {
        "val": [f"{topics[n]}\n[val]" for n in names[:16]],
        "test": [f"{topics[n]}\n[test]" for n in names[16:32]],
    }
    for split, texts in held.items():
        (out / split).mkdir(parents=True)
        pq.write_table(pa.table({"text": texts}), out / split / "part-0.parquet", row_group_size=16)
    (out / "train").mkdir()
    per_shard, shard, written, chars = 64 * 256, 0, 0, 0
    docs: list[str] = []
    for copy in range(copies):
        docs += [f"{topics[n]}\n[copy {copy}]" for n in names]
        if len(docs) >= per_shard or copy == copies - 1:
            pq.write_table(pa.table({"text": docs}), out / "train" / f"part-{shard:05d}.parquet",
                           row_group_size=256)  # fmt: skip
            written, chars, shard, docs = (
                written + len(docs),
                chars + sum(map(len, docs)),
                shard + 1,
                [],
            )
    return {"rows": {"train": written}, "mib": chars / 2**20}


def capped_train(
    recipe: str, overrides: list[str], cap_mib: int, storage: Path, name: str, env: dict[str, str]
) -> dict:
    """One run under a memory cgroup of ``cap_mib``; the run's summary and the cgroup's peak."""
    group = CGROUP_ROOT / f"convoy-stream-{os.getpid()}-{name}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(cap_mib * 2**20))
        train = [
            *CONVOY,
            "train",
            str(REPO / "recipes" / recipe),
            *(item for override in overrides for item in ("-o", override)),
            *("-o", "scaling.launcher=local", "-o", "scaling.num_workers=1"),
            *("-o", "strategy.name=single", "-o", "run.progress=off"),
            *("-o", f"run.storage_dir={storage}", "-o", f"run.name={name}"),
        ]
        # The shell joins the cgroup, then becomes convoy: everything it starts is inside.
        shell = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        started = time.perf_counter()
        done = subprocess.run(
            ["sh", "-c", shell, "sh", *train], env=env, capture_output=True, text=True
        )
        wall = time.perf_counter() - started
        if done.returncode:
            raise SystemExit(
                f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
        summary = json.loads((storage / name / "summary.json").read_text())
        peak_group = int((group / "memory.max_usage_in_bytes").read_text())
        failcnt = int((group / "memory.failcnt").read_text())
    finally:
        group.rmdir()
    return {"summary": summary, "group_peak": peak_group, "wall": wall, "failcnt": failcnt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-devices", type=int, default=64, help="1x: vehicles x 1 hour")
    parser.add_argument("--cap-mib", type=int, default=768, help="the worker's memory cap")
    parser.add_argument("--sources", default="local,s3")
    parser.add_argument("--workloads", default="telematics", help="telematics,text")
    parser.add_argument("--base-copies", type=int, default=200, help="text 1x: pydoc copies")
    parser.add_argument("--text-steps", type=int, default=40)
    parser.add_argument("--text-cap-mib", type=int, default=2048, help="the LM worker's cap")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO / "src")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="convoy-stream-") as tmp:
        server = None
        if "s3" in args.sources:
            sys.path.insert(0, str(REPO / "tests"))
            from s3server import start_s3

            server = start_s3("convoy")
            env.update(server.env)
        try:
            runs = Path(tmp) / "runs"
            for source in args.sources.split(","):
                for scale in (1, 10):
                    if "telematics" in args.workloads:
                        devices = args.base_devices * scale
                        where = (
                            f"s3://convoy/fleet-{scale}x"
                            if source == "s3"
                            else f"{tmp}/fleet-{scale}x"
                        )
                        fleet = write_fleet(where, devices, env)
                        mib = sum(fleet["rows"].values()) * fleet["bytes_per_row"] / 2**20
                        name = f"{source}-{scale}x"
                        overrides = [MODEL, f"data.path={where}", "run.epochs=1"]
                        run = capped_train(TELEMATICS, overrides, args.cap_mib, runs, name, env)
                        rows.append(("telematics", source, scale, devices, fleet["rows"], mib, run))
                        print(name, "done", flush=True)
                        if source == "local":
                            subprocess.run(["rm", "-rf", where], check=True)
                    if "text" in args.workloads and source == "local":
                        copies = args.base_copies * scale
                        where = f"{tmp}/text-{scale}x"
                        corpus = write_corpus(Path(where), copies)
                        name = f"text-{scale}x"
                        overrides = [f"data.path={where}", "data.tokenizer=bytes",
                                     f"run.max_steps={args.text_steps}",
                                     "checkpoint.every_epochs=null"]  # fmt: skip
                        run = capped_train(LM, overrides, args.text_cap_mib, runs, name, env)
                        rows.append(
                            ("text", source, scale, copies, corpus["rows"], corpus["mib"], run)
                        )
                        print(name, "done", flush=True)
                        subprocess.run(["rm", "-rf", where], check=True)
        finally:
            if server is not None:
                server.stop()
    header = (
        f"{platform.node()} ({os.cpu_count()} CPUs), {platform.python_version()}; "
        f"worker memory cap {args.cap_mib} MiB, text {args.text_cap_mib} MiB "
        "(cgroup v1 memory.limit_in_bytes); "
        f"telematics: one epoch of recipes/telematics_stream.yaml, conv1d hidden 16 depth 2, "
        f"row groups of 512 rows, 4 at a time; text: recipes/lm_tiny.yaml, bytes tokenizer, "
        f"{args.text_steps} steps, row groups of 256 documents; local launcher, strategy single"
    )
    lines = [
        "| workload | source | scale | devices / copies | train rows | data MiB | peak RSS MiB | cgroup peak MiB | cap reached (failcnt) | samples/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, source, scale, size, counts, mib, run in rows:
        summary = run["summary"]
        rss = max(summary["peak_memory_bytes_per_rank"]) / 2**20
        lines.append(
            f"| {workload} | {source} | {scale}x | {size} | {counts['train']:,} | {mib:,.0f} | "
            f"{rss:,.0f} | {run['group_peak'] / 2**20:,.0f} | {run['failcnt']} | "
            f"{summary['samples_per_second']:,.0f} | {run['wall']:.0f} |"
        )
    publish(
        args.out,
        "stream_memory",
        "Streamed data: worker memory at 1x and 10x",
        header,
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
