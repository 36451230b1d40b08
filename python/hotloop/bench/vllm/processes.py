"""The process tree of a vLLM engine and its CPU, from every thread's schedstat (``hotloop.bench.proc``).

- ``process_kind``: front_end (the root: the process that runs the front end), engine_core, worker or other, from
  the titles vLLM gives its processes (``VLLM::EngineCore``, ``VLLM::Worker_TP0``).
- ``cpu_by_process(root)``: CPU seconds by kind, each worker apart (``worker0``, ``worker1``, ...).
- ``tree_run_seconds(root)``: CPU seconds in the parts of ``IDLE_PARTS`` (torch's gloo loop threads apart: they
  tick every 10 ms in every arm); ``idle_cpu(root, windows)`` the same in percent of one core over time windows
  (blocks until the last window ends).

Cost: one read per thread of the tree per call (``proc.schedstat``), about 10 us each.
"""

from __future__ import annotations

import time

from hotloop.bench.proc import schedstat, thread_name, tree

GLOO_LOOP_THREAD = "gloo_tcp_loop"  # torch's gloo transport: one per gloo device, epoll_wait with a 10 ms tick
IDLE_PARTS = ("tree", "gloo", "waiters", "front_end", "other")


def tree_run_seconds(root: int) -> dict[str, float]:
    """CPU seconds of every thread of `root` and its live descendants (proc.schedstat: exact where utime + stime
    would charge an idle thread whole clock ticks), in parts:
    "tree" (all), "gloo" (torch's gloo loop threads), "waiters" (the main threads of the engine core and the
    workers: where the queue's and the engine-core loop's waits run), "front_end" (the other threads of `root`, the
    process that runs the front end) and "other" (every other thread: vLLM's input / output threads, ZeroMQ's ...)."""
    parts = dict.fromkeys(IDLE_PARTS, 0)
    for pid, cmd in tree(root).items():
        waiter_process = "EngineCore" in cmd or "Worker" in cmd
        for tid, (ns, _waited) in schedstat(pid).items():
            part = ("gloo" if thread_name(pid, tid) == GLOO_LOOP_THREAD else "waiters" if waiter_process and tid == pid
                    else "front_end" if pid == root else "other")
            parts["tree"] += ns
            parts[part] += ns
    return {k: v / 1e9 for k, v in parts.items()}


def process_kind(pid: int, cmd: str, root: int) -> str:
    """front_end (the process that runs the front end), engine_core, worker (vLLM's VLLM::Worker*) or other."""
    if pid == root:
        return "front_end"
    if "EngineCore" in cmd:
        return "engine_core"
    if "Worker" in cmd:
        return "worker"
    return "other"


def cpu_by_process(root: int) -> dict[str, float]:
    """CPU seconds (every thread's schedstat) of `root`'s tree by process kind (process_kind); the workers one by
    one, worker0, worker1, ... in the order of their pids (the order vLLM starts its ranks in)."""
    out: dict[str, float] = {}
    found = tree(root)
    workers = sorted(pid for pid, cmd in found.items() if process_kind(pid, cmd, root) == "worker")
    for pid, cmd in found.items():
        kind = process_kind(pid, cmd, root)
        if kind == "worker":
            kind = f"worker{workers.index(pid)}"
        out[kind] = out.get(kind, 0.0) + sum(ns for ns, _waited in schedstat(pid).values()) / 1e9
    return out


def idle_cpu(root: int, windows=((0.0, 3.0),)) -> list[dict[str, float]]:
    """CPU of `root`'s tree in percent of one core over each window (seconds after now), in the parts of
    tree_run_seconds."""
    t0 = time.monotonic()
    res = []
    for start, end in windows:
        time.sleep(max(0.0, t0 + start - time.monotonic()))
        c0, w0 = tree_run_seconds(root), time.monotonic()
        time.sleep(max(0.0, t0 + end - time.monotonic()))
        c1 = tree_run_seconds(root)
        dt = time.monotonic() - w0
        res.append({k: 100.0 * (c1[k] - c0[k]) / dt for k in IDLE_PARTS})
    return res
