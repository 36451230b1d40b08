"""read_cpu: the exact CPU a vLLM process's queue reads spend waiting, counted the same way on vLLM's queue and on
hotloop's.

Contract:

- ``install()`` (the plugin calls it in every vLLM process where ``HOTLOOP_VLLM_READ_CPU`` is 1/true/yes/on, on
  either queue, so every arm of a benchmark is measured alike) wraps, with the calling thread's CPU clock
  (``time.thread_time_ns``: CLOCK_THREAD_CPUTIME_ID, exact, no sampling):
  - each queue read: ``dequeue`` of vLLM's ``MessageQueue`` (``shm_broadcast``) and of ``hotloop.vllm``'s;
  - the deserialization inside it, in both: vLLM's ``pickle.loads`` (the name ``shm_broadcast`` calls it by) and
    hotloop's loaders (the ring's bare ``pickle.loads`` and its general ``loads``, which hotloop's reads call from
    C++ while the wait's frame is still on the stack: a sampler cannot tell them apart there, this can).
  A read's waiting CPU is its CPU less its deserialization's: the spin, the yields, the futex calls, the
  bookkeeping around them. A read of vLLM's queue that waits spins on ``sched_yield``; hotloop's parks.
- ``totals()``: this process's reads so far, every thread together: ``{"reads", "read_cpu_ns", "loads_cpu_ns",
  "wait_cpu_ns", "read_wall_ns"}`` (a vLLM worker's ``collective_rpc`` or the engine core's timeline call reads
  it; the bench takes differences over a load shape and reports waiting CPU per 1000 output tokens).
- A sampler (``bench/host_samples.py``) sees the unpickling as the wrapper's frame (``timed``, this module), not
  as the read's: work in both arms, as the exact count has it.
- Cost: two thread-clock reads per read and two per deserialization (a system call each, ~0.3-1 us on this VM),
  and a Python frame around each: for benchmarks, off by default. ``uninstall()`` puts everything back.
"""

from __future__ import annotations

import importlib
import os
import pickle
import threading
import time
import types

from hotloop.vllm.class_patches import ClassPatches

ENV = "HOTLOOP_VLLM_READ_CPU"
_SHM_BROADCAST = "vllm.distributed.device_communicators.shm_broadcast"
_patches = ClassPatches()
_module_patches = ClassPatches()  # module globals replaced (deserialization's entry points)
_lock = threading.Lock()
_totals = {"reads": 0, "read_cpu_ns": 0, "loads_cpu_ns": 0, "read_wall_ns": 0}
_local = threading.local()  # .loads_ns: the deserialization CPU of the read running in this thread


def _timed_loads(loads):
    def timed(*args, **kwargs):
        c0 = time.thread_time_ns()
        try:
            return loads(*args, **kwargs)
        finally:
            _local.loads_ns = getattr(_local, "loads_ns", 0) + time.thread_time_ns() - c0

    return timed


def _timed_read(dequeue):
    def timed(self, *args, **kwargs):
        outer = getattr(_local, "in_read", False)
        if outer:  # a read inside a read (a subclass calling its base): the outer one counts
            return dequeue(self, *args, **kwargs)
        _local.in_read, _local.loads_ns = True, 0
        w0, c0 = time.monotonic_ns(), time.thread_time_ns()
        try:
            return dequeue(self, *args, **kwargs)
        finally:
            cpu, wall = time.thread_time_ns() - c0, time.monotonic_ns() - w0
            loads_ns, _local.in_read = _local.loads_ns, False
            with _lock:
                _totals["reads"] += 1
                _totals["read_cpu_ns"] += cpu
                _totals["loads_cpu_ns"] += min(loads_ns, cpu)
                _totals["read_wall_ns"] += wall

    timed.__wrapped__ = dequeue
    return timed


def requested() -> bool:
    from hotloop.vllm import env_flag

    return env_flag(ENV) is True


def install() -> list[str]:
    """Wrap both queues' reads and their deserialization (see the contract). Returns what was wrapped."""
    if _patches:
        return _patches.owners()
    from hotloop.queue import message_queue as hl_queue
    from hotloop.queue import serialization
    from hotloop._core import ObjectLoaders
    from hotloop.vllm.message_queue import MessageQueue as HotloopQueue

    shm_broadcast = importlib.import_module(_SHM_BROADCAST)
    vllm_queue = _vllm_queue(shm_broadcast)
    # vLLM's reads deserialize with shm_broadcast's `pickle.loads`: that module's `pickle`, with loads timed
    timed_pickle = types.ModuleType("pickle")
    timed_pickle.__dict__.update(pickle.__dict__)
    timed_pickle.loads = _timed_loads(pickle.loads)
    _module_patches.set(shm_broadcast, "pickle", timed_pickle)
    # hotloop's reads deserialize with the loaders the ring calls from C++ (queue/serialization.py)
    loaders = ObjectLoaders(_timed_loads(serialization._pickle_loads), _timed_loads(serialization.loads),
                            serialization.NOTHING)
    _module_patches.set(hl_queue, "_OBJECT_LOADERS", loaders)
    for cls in {vllm_queue, HotloopQueue}:
        _patches.set(cls, "dequeue", _timed_read(cls.dequeue))
    return _patches.owners()


def _vllm_queue(shm_broadcast):
    """vLLM's own MessageQueue class, also where the plugin has put hotloop's in its place."""
    from hotloop import vllm as plugin

    return plugin._original or shm_broadcast.MessageQueue


def uninstall() -> None:
    _patches.restore()
    _module_patches.restore()


def totals(_self=None) -> dict:
    """This process's reads so far (see the contract)."""
    with _lock:
        out = dict(_totals)
    out["wait_cpu_ns"] = out["read_cpu_ns"] - out["loads_cpu_ns"]
    return out


__all__ = ["ENV", "install", "requested", "totals", "uninstall"]
