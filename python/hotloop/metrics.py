"""hotloop.metrics: what the waits of this process did, as dicts and (optionally) as Prometheus metrics.

Contract. The C++ core counts every wait that returns (not one that raises), at no cost beyond a few plain
counter updates per wait (no clock read, no locked instruction on the wait path): how many waits ended in each
phase (immediate, spin, yield, park, timeout), the time spent spinning, yielding and parked, spin iterations,
kernel sleeps, and a log2 histogram of wake-up latencies (from a source becoming ready to the waiter running
again: parks woken by a ring, and step completions; a spin wake-up costs one spin iteration and is counted, not
timed). Counters only grow; take differences.

- ``snapshot()``: the whole process (every thread, exited ones too) and every registered collector, as a dict.
- ``Waiter.stats``, ``MessageQueue.wait_stats`` (a local reader's or the writer's ring waits), a step
  notifier's ``stats`` (marks, completions, completion -> waiter latency): the same dicts for one object.
- ``WaitMetrics`` + ``collect(m)``: counts the waits of the calling thread inside the ``with`` block into ``m``
  (an engine loop does this). ``register(read, **labels)`` adds a reader of such a dict to ``snapshot()`` and to
  the Prometheus collector under those labels (the engine: ``component="engine", wait_mode=...``); a reader
  may also return ``{"counters": {name: n}, "gauges": {name: x}}`` (the orchestrator's per-replica figures,
  exported as ``hotloop_<name>``), or a list of ``(labels, dict)`` pairs for several series at once.
- ``PrometheusCollector`` (needs ``prometheus_client``, the ``metrics`` extra): exposes all of it with
  Prometheus names (``hotloop_wait_wakeups_total{phase=...}``, ``hotloop_wake_latency_seconds``, ...; see
  docs/metrics.md). Series with ``scope="process"`` cover every wait of the process; registered ones are
  subsets of it (do not add them up).

The wait dict: ``{"waits": {phase: n}, "phase_ns": {"spin"|"yield"|"park": ns}, "spin_iterations": n,
"yields": n, "parks": n, "safety_wakeups": n, "wake_latency": {"buckets": [n] * 32, "count": n, "sum_ns": n}}``;
latency bucket k counts latencies in [2**(k-1), 2**k) ns (bucket 0: 0 ns; the last: everything above 2**30 ns).
A step dict: ``{"marks": n, "completions": n, "wake_latency": {...}}``.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from contextlib import contextmanager
from typing import Callable

from hotloop._core import WaitMetrics, latency_buckets, process_wait_metrics, set_thread_wait_metrics

__all__ = ["WaitMetrics", "collect", "counted", "register", "unregister", "snapshot", "latency_quantile",
           "wait_split", "PrometheusCollector", "WAIT_ENDS", "PHASES"]

WAIT_ENDS = ("immediate", "spin", "yield", "park", "timeout")  # where a wait can end
PHASES = ("spin", "yield", "park")  # where a wait spends time

_local = threading.local()
_lock = threading.Lock()
_registered: dict[int, tuple[dict[str, str], Callable[[], dict]]] = {}
_ids = itertools.count(1)


@contextmanager
def collect(metrics: WaitMetrics):
    """Count the calling thread's waits inside the block into ``metrics`` too (blocks nest)."""
    previous = getattr(_local, "current", None)
    set_thread_wait_metrics(metrics)
    _local.current = metrics
    try:
        yield metrics
    finally:
        set_thread_wait_metrics(previous)
        _local.current = previous


def _check_labels(labels: dict) -> dict[str, str]:
    bad = [k for k in labels if k in ("scope", "phase") or not k.isidentifier()]
    if bad:
        raise ValueError(f"label names must be identifiers other than scope and phase (hotloop uses them), got {bad}")
    return {k: str(v) for k, v in labels.items()}


def register(read: Callable[[], dict | list], **labels: str) -> int:
    """Add ``read`` to ``snapshot()`` and the Prometheus collector, under ``labels``. ``read()`` returns a wait
    dict, a step dict, ``{"counters": {...}, "gauges": {...}}``, or a list of ``(more_labels, dict)``. Returns
    a handle for ``unregister``. Called on every snapshot or scrape: keep it cheap. A bound method is held
    weakly (its object's death unregisters it); anything else is held until ``unregister``."""
    labels = _check_labels(labels)
    if inspect.ismethod(read) and not isinstance(read.__self__, type):
        try:
            read = weakref.WeakMethod(read)
        except TypeError:  # an object without weak references (a C++ one): held strongly
            pass
    handle = next(_ids)
    with _lock:
        _registered[handle] = (labels, read)
    return handle


def unregister(handle: int) -> None:
    """Remove a registration (unknown handles are ignored, so a double unregister is harmless)."""
    with _lock:
        _registered.pop(handle, None)


@contextmanager
def counted(metrics: WaitMetrics, **labels: str):
    """``collect(metrics)`` while registered under ``labels``: what an engine loop wraps its run in."""
    handle = register(metrics.snapshot, **labels)
    try:
        with collect(metrics):
            yield metrics
    finally:
        unregister(handle)


def snapshot() -> dict:
    """``{"process": <wait dict of every wait of this process>, "registered": [{"labels": {...}, "stats":
    <dict>}, ...]}`` (a reader that returns several series gives one entry each)."""
    with _lock:
        entries = list(_registered.items())
    registered = []
    for handle, (labels, read) in entries:
        if isinstance(read, weakref.WeakMethod):
            read = read()
            if read is None:
                unregister(handle)
                continue
        got = read()
        for more, stats in (got if isinstance(got, list) else [({}, got)]):
            registered.append({"labels": {**labels, **_check_labels(more)}, "stats": stats})
    return {"process": process_wait_metrics(), "registered": registered}


def latency_quantile(latency: dict, q: float) -> float | None:
    """The q-quantile (0..1) of a wake_latency dict in seconds, as the upper bound of the bucket that holds it
    (None when empty). Coarse by design: buckets are powers of two."""
    n = latency["count"]
    if n == 0:
        return None
    rank, seen = q * n, 0
    for k, c in enumerate(latency["buckets"]):
        seen += c
        if seen >= rank and c:
            return (2 ** k) / 1e9
    return (2 ** (latency_buckets - 1)) / 1e9


def wait_split(after: dict, before: dict | None = None) -> dict:
    """The waits of a wait dict (since ``before``, if given), as their count and the share (0..1) that ended in
    each phase."""
    ends = {p: after["waits"][p] - (before["waits"][p] if before else 0) for p in WAIT_ENDS}
    n = sum(ends.values())
    return {"waits": n, **{p: (ends[p] / n if n else 0.0) for p in WAIT_ENDS}}


# ---- Prometheus ----------------------------------------------------------------------------------------------

# Exported bucket bounds: 2**k ns for even k from 256 ns to ~1.07 s (12 bounds + Inf), taken from the 32 log2
# buckets (a cumulative count at a bound is exact, since every bound is a bucket edge).
_EXPORTED_BOUNDS = range(8, 31, 2)


def _add_histogram(family, label_values: list[str], latency: dict) -> None:
    """Adds a wake_latency dict to a HistogramMetricFamily: cumulative counts at the exported bounds, seconds."""
    out, cumulative, buckets = [], 0, latency["buckets"]
    for k in range(latency_buckets):
        cumulative += buckets[k]
        if k in _EXPORTED_BOUNDS:
            out.append((repr((2 ** k) / 1e9), cumulative))
    out.append(("+Inf", cumulative))
    family.add_metric(label_values, out, latency["sum_ns"] / 1e9)


class PrometheusCollector:
    """A prometheus_client collector of hotloop's metrics (register it with ``REGISTRY.register(...)`` or pass
    ``registry=``). Every scrape reads the counters afresh; nothing is kept between scrapes."""

    def __init__(self, registry=None):
        try:
            import prometheus_client  # noqa: F401
        except ImportError as e:
            raise ImportError("the Prometheus collector needs prometheus_client: pip install 'hotloop[metrics]'") from e
        if registry is not None:
            registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = snapshot()
        series = [({"scope": "process"}, snap["process"])]
        series += [({"scope": "registered", **e["labels"]}, e["stats"]) for e in snap["registered"]]
        names = sorted({k for labels, _ in series for k in labels})
        waits = [(labels, s) for labels, s in series if "waits" in s]
        steps = [(labels, s) for labels, s in series if "marks" in s]

        def values(labels):
            return [labels.get(k, "") for k in names]

        wakeups = CounterMetricFamily("hotloop_wait_wakeups", "Waits ended, by the phase they ended in "
                                      "(immediate: ready at once; timeout: nothing ready by the deadline).",
                                      labels=names + ["phase"])
        seconds = CounterMetricFamily("hotloop_wait_phase_seconds", "Time waits spent spinning, yielding and "
                                      "parked in the kernel.", labels=names + ["phase"])
        spins = CounterMetricFamily("hotloop_wait_spin_iterations", "Spin-loop iterations (each one check of "
                                    "the sources and a pause).", labels=names)
        parks = CounterMetricFamily("hotloop_wait_parks", "Kernel sleeps (futex, ppoll, io_uring).", labels=names)
        yields = CounterMetricFamily("hotloop_wait_yields", "sched_yield calls.", labels=names)
        latency = HistogramMetricFamily("hotloop_wake_latency_seconds", "Source ready -> waiter running again, for "
                                        "parks woken by a ring and for step completions.", labels=names)
        for labels, s in waits:
            v = values(labels)
            for phase in WAIT_ENDS:
                wakeups.add_metric(v + [phase], s["waits"][phase])
            for phase in PHASES:
                seconds.add_metric(v + [phase], s["phase_ns"][phase] / 1e9)
            spins.add_metric(v, s["spin_iterations"])
            parks.add_metric(v, s["parks"])
            yields.add_metric(v, s["yields"])
            _add_histogram(latency, v, s["wake_latency"])
        yield from (wakeups, seconds, spins, parks, yields, latency)
        yield from self._plain(series, values, "counters", CounterMetricFamily, names)
        yield from self._plain(series, values, "gauges", GaugeMetricFamily, names)
        if steps:
            marks = CounterMetricFamily("hotloop_step_marks", "Steps marked on a step notifier.", labels=names)
            done = CounterMetricFamily("hotloop_step_completions", "Steps completed (or failed).", labels=names)
            step_latency = HistogramMetricFamily("hotloop_step_wake_latency_seconds", "Step completion -> the "
                                                 "waiter on it running again.", labels=names)
            for labels, s in steps:
                v = values(labels)
                marks.add_metric(v, s["marks"])
                done.add_metric(v, s["completions"])
                _add_histogram(step_latency, v, s["wake_latency"])
            yield from (marks, done, step_latency)

    @staticmethod
    def _plain(series, values, kind, family_type, names):
        families = {}
        for labels, s in series:
            for name, value in s.get(kind, {}).items():
                if name not in families:
                    families[name] = family_type("hotloop_" + name, f"hotloop {name.replace('_', ' ')}", labels=names)
                families[name].add_metric(values(labels), value)
        yield from families.values()
