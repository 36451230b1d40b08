"""Helpers shared by the benchmarks: percentiles and figures over rounds, a progress line, tables, goals and their
verdicts, the JSON record, and plots. What they read of /proc is in proc.py."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time


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


class Table(str):
    """One table of a benchmark's output: its text as printed (the str itself), and its parts for the report page
    (``title``, ``headers``, ``rows`` of formatted cells, ``note``; ``key``: the part of the benchmark's results it
    shows, which its goals name, "" when none)."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str
    key: str

    def __new__(cls, title: str, headers: list[str], rows: list[list], note: str = "", key: str = ""):
        cells = [[fmt(c) for c in row] for row in rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
        line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
        out = [title, line, "-" * len(line)]
        for r in cells:
            out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if note:
            out.append(note)
        self = super().__new__(cls, "\n".join(out))
        self.title, self.headers, self.rows, self.note, self.key = title, list(headers), cells, note, key
        return self


def over_rounds(xs) -> dict:
    """One figure over a benchmark's rounds: its median, min and max, and the runs themselves (``median_range``
    makes the table cell)."""
    return {"median": median(xs), "min": min(xs), "max": max(xs), "runs": list(xs)}


def median_spread(xs) -> tuple[float, float]:
    """(median, half the range; nan for a single value) of one figure over rounds."""
    return median(xs), (max(xs) - min(xs)) / 2 if len(xs) > 1 else math.nan


def median_range(st: dict, digits: int) -> str:
    """A table cell from a summary of rounds: "median (min-max)"."""
    return f"{fmt(st['median'], digits)} ({fmt(st['min'], digits)}-{fmt(st['max'], digits)})"


def table(title: str, headers: list[str], rows: list[list], note: str = "", key: str = "") -> Table:
    return Table(title, headers, rows, note, key)


class Report(list):
    """A benchmark's printed output in order: Tables and paragraphs (str). ``str()`` is the text ``hotloop bench``
    prints (parts separated by a blank line); the report page draws each Table as an HTML table."""

    def __str__(self) -> str:
        return "\n\n".join(str(p) for p in self)


@dataclasses.dataclass(frozen=True)
class Goal:
    """One goal a benchmark states for one row of one of its tables: the row's ``metric`` ``op`` (``"<="`` or
    ``">="``) ``limit``. The figure is the row's own (``against`` None: an absolute goal, in ``unit``) or its ratio
    to the same metric of row ``against`` of the same table, the baseline (a ratio goal: "p50 <= 1.5x the bytes
    path"). ``table`` is the key of the table in the benchmark's results ("" for the top level), ``metric`` a dotted
    path into the row ("latency.p50_us"), ``says`` the goal in words, naming the row."""

    says: str
    table: str
    row: str
    metric: str
    op: str
    limit: float
    against: str | None = None
    unit: str = ""

    def check(self, results: dict) -> dict:
        """The verdict on this goal in a benchmark's results, ready for JSON: the goal's fields, ``value`` (the
        figure compared with ``limit``: the row's own, or its ratio to the baseline's), ``row_value`` and
        ``against_value`` (the figures it came from), and ``met``: True, False, or None when a figure is missing
        (not measured in this run)."""
        rows = _lookup(results, self.table) if self.table else results
        own = _lookup(rows, self.row, self.metric)
        base = _lookup(rows, self.against, self.metric) if self.against else None
        value = own if self.against is None else (own / base if _finite(own) and _finite(base) and base else None)
        met = None
        if _finite(value):
            met = bool(value <= self.limit if self.op == "<=" else value >= self.limit)
        return {**dataclasses.asdict(self), "value": value if _finite(value) else None,
                "row_value": own if _finite(own) else None, "against_value": base if _finite(base) else None,
                "met": met}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _lookup(data, *keys):
    """data[k1][k2]..., each key a dotted path ("latency.p50_us"; a key that holds a dot itself is tried whole
    first); None where a part is missing."""
    for key in keys:
        while True:
            if not isinstance(data, dict):
                return None
            if key in data:
                data = data[key]
                break
            head, dot, key = key.partition(".")
            if not dot or head not in data:
                return None
            data = data[head]
    return data


def check_goals(goals: list[Goal], results: dict) -> list[dict]:
    """Every goal's verdict (Goal.check), in order: what a benchmark stores under ``"goals"`` in its results."""
    return [g.check(results) for g in goals]


def _figure(x: float) -> str:
    """Three significant digits without an exponent: 84.9, 0.0562, 1.58, 174,610."""
    if x == 0 or abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def verdict_word(v: dict) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[v.get("met")]


def verdict_text(v: dict) -> tuple[str, str]:
    """A goal's verdict in words: (the goal, what was measured against it). Takes Goal.check's dicts, and the
    ``{"goal", "met", "detail"}`` ones of benchmarks that judge their goals themselves (vllm)."""
    if "says" not in v:
        return v.get("goal", "?"), v.get("detail", "")
    unit = f" {v['unit']}" if v["unit"] else ""
    if v["against"] is None:
        goal = f"{v['op']} {v['limit']:g}{unit}"
        if v["value"] is None:
            return v["says"], f"not measured (no {v['metric']} for {v['row']!r}); goal {goal}"
        ratio = f" ({_figure(v['value'] / v['limit'])}x the goal)" if v["limit"] else ""
        return v["says"], f"{_figure(v['value'])}{unit}, goal {goal}{ratio}"
    goal = f"{v['op']} {v['limit']:g}x {v['against']}"
    if v["value"] is None:
        missing = [r for r, x in ((v["row"], v["row_value"]), (v["against"], v["against_value"])) if x is None]
        return v["says"], f"not measured (no {v['metric']} for {' or '.join(map(repr, missing))}); goal {goal}"
    return v["says"], (f"{_figure(v['value'])}x ({_figure(v['row_value'])}{unit} vs {_figure(v['against_value'])}"
                       f"{unit}), goal {goal}")


def goal_lines(goals: list[dict]) -> str:
    """The goals of a benchmark that judges them itself (``{"goal", "met", "detail"}``), a line each, as it prints
    them under its tables: 'goal <goal>: met (<detail>)'."""
    return "\n".join(f"goal {g['goal']}: {verdict_word(g)} ({g['detail']})" for g in goals)


def verdict_line(bench: str, v: dict) -> str:
    """One line of the verdict: 'NOT met  wait: <goal>: <measured>'."""
    goal, measured = verdict_text(v)
    return f"{verdict_word(v):12s} {bench}: {goal}: {measured}"


def print_result(bench: str, data: dict, text, json_path: str | None = None) -> int:
    """What a benchmark's ``python -m`` entry prints last: its text, a verdict line per goal in ``data["goals"]``,
    and ``data`` as JSON into `json_path` when given. Returns 0 (the exit status)."""
    print(text)
    for v in data.get("goals", []):
        print(verdict_line(bench, v))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=2, default=float)
    return 0


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
