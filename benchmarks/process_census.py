"""Process census: the CPU-seconds of every process a command starts, by kind of process.

Question (issue 40): where does the test suite's CPU go? Not by test (``make test``'s bill
gives that) but by what does the work: pytest's own workers, the train workers Ray Train
starts, its controller and helper actors, Ray's daemons, torchrun's and the tests' Python
subprocesses, the C++ compiler Inductor calls. The answer says which costs are Convoy's to
cut and which come with every Ray Train run or every ``import torch``.

Method: the kernel's process accounting (``acct(2)``, BSD format v3) is switched on into a
file, the command runs, and accounting is switched off. The kernel writes one record for every
process that exits, however short its life (while the file system has 2% free), with its user + system CPU time (to 1/100 s) and
its name (``comm``: the first 15 characters; Ray names its workers ``ray::<class>``). Nothing
is sampled, so nothing is missed between samples. The census counts every process that ends
on the machine meanwhile, so keep the machine quiet; a process still running when accounting
stops is not counted. Needs root.

    .venv/bin/python benchmarks/process_census.py [--out benchmarks] -- COMMAND...
    .venv/bin/python benchmarks/process_census.py --read FILE.acct    # a file kept before
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dated import publish

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
# etime (a float), then 8 comp_t (utime, stime, mem, io, rw, minflt, majflt, swaps), comm[16].
RECORD = struct.Struct("<ccHIIIIIIf8H16s")
ACCT_HZ = 100  # comp_t times are in AHZ ticks
KINDS = (
    # (kind, names starting with one of these)
    ("Ray Train workers", ("ray::RayTrainWo",)),
    ("Ray Train controller, synchronization actor, dataset manager",
     ("ray::TrainContr", "ray::Synchroniz", "ray::DatasetMan", "ray::PlacementG")),
    ("Ray Data actors", ("ray::_Autoscali", "ray::_StatsActo", "ray::ActorLocat", "ray::MapWorker",
                         "ray::SplitCoord", "ray::OutputSpl")),
    ("Ray daemons and the ray CLI", ("ray::Dashboard", "ray::RuntimeEnv", "ray-dashboard",
                                     "gcs_server", "raylet", "ray::Monitor")),
    ("other Ray workers (tasks, idle workers, Tune trials, Convoy's actors)", ("ray::",)),
    ("the C++ compiler and linker (Inductor)", ("cc1plus", "g++", "c++", "collect2")),
    ("Python: pytest, torchrun's workers, gloo ranks, subprocesses", ("python", "pt_main_thread")),
)  # fmt: skip


@dataclass(frozen=True)
class Exited:
    pid: int
    ppid: int
    name: str
    cpu_s: float


def comp_t(value: int) -> int:
    """A ``comp_t``: 13-bit mantissa, 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 7))


def read_accounting(path: Path) -> Iterator[Exited]:
    data = path.read_bytes()
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        if fields[1][0] & 0x7F != 3:  # v1/v2 records are 64 bytes too, laid out otherwise
            sys.exit(f"{path}: not BSD accounting v3 records (version {fields[1][0] & 0x7F})")
        cpu = (comp_t(fields[10]) + comp_t(fields[11])) / ACCT_HZ
        name = fields[18].split(b"\0")[0].decode(errors="replace")
        yield Exited(fields[6], fields[7], name, cpu)


def kind_of(name: str) -> str:
    if name == "ray":
        return "Ray daemons and the ray CLI"
    if name in ("as", "ld"):  # the assembler and linker g++ runs
        return "the C++ compiler and linker (Inductor)"
    for kind, prefixes in KINDS:
        if name.startswith(prefixes):
            return kind
    return "other"


def account(command: list[str], path: Path) -> int:
    """Run ``command`` with process accounting into ``path``; its exit code."""
    libc = ctypes.CDLL(None, use_errno=True)
    path.touch()
    if libc.acct(str(path).encode()) != 0:
        errno = ctypes.get_errno()
        sys.exit(f"process accounting could not start (needs root): {os.strerror(errno)}")

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # so that the finally below switches accounting off

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return subprocess.call(command)
    finally:
        libc.acct(None)
        signal.signal(signal.SIGTERM, previous)


def tables(exited: list[Exited]) -> str:
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for process in exited:
        for table, key in ((by_kind, kind_of(process.name)), (by_name, process.name)):
            table[key][0] += process.cpu_s
            table[key][1] += 1
    total = sum(p.cpu_s for p in exited) or 1e-9  # shares of nothing are 0%
    lines = [
        f"{total:,.1f} CPU-s in {len(exited):,} processes.",
        "",
        "| kind of process | CPU-s | share | processes | CPU-s each |",
        "|---|---|---|---|---|",
    ]
    for kind, (cpu, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        lines.append(f"| {kind} | {cpu:,.1f} | {cpu / total:.1%} | {count:,} | {cpu / count:.2f} |")
    lines += ["", "| process name | CPU-s | processes | CPU-s each |", "|---|---|---|---|"]
    for name, (cpu, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:25]:
        lines.append(f"| `{name}` | {cpu:,.1f} | {count:,} | {cpu / count:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--read", type=Path, help="an accounting file kept before")
    parser.add_argument("--keep", type=Path, help="where to keep this run's accounting file")
    parser.add_argument("--out", type=Path, help="folder for the dated markdown file")
    parser.add_argument("command", nargs="*", help="the command, after --")
    args = parser.parse_args()
    if bool(args.read) == bool(args.command):
        parser.error("give either a command (after --) or --read FILE")
    header = f"Command: `{' '.join(args.command)}`" if args.command else f"From {args.read}"
    if args.read:
        path = args.read
    else:
        path = args.keep or Path(tempfile.mkstemp(prefix="convoy-census-", suffix=".acct")[1])
        path.write_bytes(b"")
        code = account(args.command, path)
        header += f" (exit code {code}; accounting kept in {path})"
    title = "Process census: CPU-seconds by kind of process"
    publish(args.out, "process_census", title, header, tables(list(read_accounting(path))))
    if args.command and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
