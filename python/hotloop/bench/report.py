"""Helpers shared by the benchmarks: percentiles, a progress line, tables, and the JSON record."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import NamedTuple


def percentile(values, q):
    """The q-th percentile (0-100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values):
    return statistics.median(values) if values else math.nan


def summarize_us(values_ns):
    """p50/p99/max of nanosecond samples, in microseconds."""
    return {
        "n": len(values_ns),
        "p50_us": percentile(values_ns, 50) / 1e3,
        "p99_us": percentile(values_ns, 99) / 1e3,
        "max_us": (max(values_ns) / 1e3) if values_ns else math.nan,
    }


class Progress:
    """One status line on stderr (rewritten in place on a terminal, one line per step otherwise)."""

    def __init__(self, title: str, total: int):
        self.title, self.total, self.done = title, total, 0
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()

    def step(self, what: str):
        self.done += 1
        msg = f"[{self.title}] {self.done}/{self.total} {what} ({time.monotonic() - self.t0:.0f} s)"
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def fmt(x, digits=1):
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def table(title: str, headers: list[str], rows: list[list], note: str = "") -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    out = [title, line, "-" * len(line)]
    for r in cells:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if note:
        out.append(note)
    return "\n".join(out)


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


def process_tree_cpu_seconds(root: int) -> float:
    """utime + stime of `root` and every live descendant, in seconds (children that exited are not counted)."""
    procs = processes()
    return sum(procs[pid].cpu_s for pid in descendants(procs, root))


async def time_stream(stream, t0: float):
    """Time an async stream of outputs started at perf_counter() `t0`: (seconds to the first output, the gaps
    between the next ones, the outputs)."""
    first, last, gaps, outs = None, t0, [], []
    async for out in stream:
        now = time.perf_counter()
        if first is None:
            first = now - t0
        else:
            gaps.append(now - last)
        last = now
        outs.append(out)
    return first, gaps, outs


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (the bench extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_PLOT = "no plot: matplotlib is not installed (pip install hotloop[bench])"


def cdf_panel(ax, series: dict, title: str, ylabel: str = "fraction") -> None:
    """One panel of empirical distributions (label -> values in ms), log x axis."""
    for label, values in series.items():
        xs = sorted(values)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set(title=title, xlabel="ms", ylabel=ylabel)
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
