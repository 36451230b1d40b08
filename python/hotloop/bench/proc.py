"""What the benchmarks read of /proc: the process table, a process's command line and descendants, and each
thread's CPU from its schedstat. Linux only; every reader is a snapshot and skips what ends while it reads.

- ``processes()``: every live process, pid -> ``Proc`` (parent pid, utime + stime in seconds: sampled at the clock
  tick, good for seconds of load, not for the microseconds of an idle thread).
- ``schedstat(pid)``: per live thread, the nanoseconds the scheduler ran it and those it waited on a run queue:
  exact, so idle CPU and short windows are read here. The one reader of ``/proc/<pid>/task/<tid>/schedstat``.
- ``tree(root)``: the command lines of `root` and its live descendants (vLLM retitles its processes:
  ``VLLM::EngineCore``, ``VLLM::Worker_TP0``, ...).

Cost: one open and read per process (``processes``) or per thread (``schedstat``), about 10 us each.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Proc(NamedTuple):
    ppid: int
    cpu_s: float  # utime + stime


def processes() -> dict[int, Proc]:
    """Every live process: pid -> Proc."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(p)] = Proc(int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return procs


def alive(pid: int) -> bool:
    """Whether `pid` runs (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> bytes | None:
    """The process's command line (NUL-separated), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def descendants(procs: dict[int, Proc], root: int) -> list[int]:
    """`root` and its descendants among `procs` (those alive when the table was read)."""
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        children.setdefault(proc.ppid, []).append(pid)
    out, stack, seen = [], [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen or pid not in procs:
            continue
        seen.add(pid)
        out.append(pid)
        stack.extend(children.get(pid, ()))
    return out


def tree(root: int) -> dict[int, str]:
    """pid -> command line (its arguments joined by spaces) of `root` and its live descendants."""
    found = {pid: cmdline(pid) for pid in descendants(processes(), root)}
    return {pid: line.replace(b"\0", b" ").decode(errors="replace").strip() for pid, line in found.items()
            if line is not None}


def process_tree_cpu_seconds(root: int) -> float:
    """utime + stime of `root` and every live descendant, in seconds (children that exited are not counted)."""
    procs = processes()
    return sum(procs[pid].cpu_s for pid in descendants(procs, root))


def schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (ns run on a CPU, ns waited on a run queue) of every live thread of `pid`; {} once `pid` is gone.

    From /proc/<pid>/task/<tid>/schedstat: the nanoseconds the scheduler accounted. utime + stime are sampled at
    the clock tick instead, which over a few seconds of near-idle charges a whole 10 ms tick to a thread that ran
    microseconds when the tick hit it."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out[int(tid)] = (int(run), int(wait))
        except (OSError, ValueError):
            pass
    return out


def thread_name(pid: int, tid: int) -> str:
    """The thread's name (its comm), "" once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
