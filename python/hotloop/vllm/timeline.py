"""Queue wait inside vLLM's engine core: how long a request waits between reaching the engine core and the scheduler
having it, on vLLM's own loop and on hotloop's (``engine_loop.py``).

Contract:

- ``install()`` (the plugin calls it in the engine-core process when ``HOTLOOP_VLLM_TIMELINE`` is 1/true/yes/on,
  whether or not hotloop's queue is on, so both arms of a benchmark measure the same way) wraps two methods of
  vLLM's ``EngineCore``: ``preprocess_add_request`` (run by the input thread right after it decoded an ADD: the
  request has reached the engine core) and ``add_request`` (run by the main thread: the request goes into the
  scheduler). Each is stamped with ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for every process of the
  machine). Cost: two clock reads and a dict operation per request.
- ``EngineCore.hotloop_queue_waits()`` is then a vLLM utility method (``call_utility_async("hotloop_queue_waits")``
  from a client): it returns ``{"request_ids": [...], "waits_us": [...], "during_step": [...]}`` for the requests added since
  the last call (vLLM's request id; the wait in microseconds; whether the main thread took it while an engine step was running, i.e.
  through the engine-core loop) and forgets them.
- Off: nothing is wrapped. ``uninstall()`` restores vLLM's methods.
"""

from __future__ import annotations

import collections
import functools
import time

_ENGINE_CORE = "vllm.v1.engine.core"
_MAX = 1 << 16  # samples kept between two reads (the oldest dropped beyond that)

_arrived: dict[str, int] = {}  # request id -> monotonic ns at the engine core's input thread
_waits: collections.deque = collections.deque(maxlen=_MAX)  # (request id, wait us, during a step)
_saved: dict = {}


def _stamp_arrival(preprocess):
    @functools.wraps(preprocess)
    def wrapper(self, request, *args, **kwargs):
        t = time.monotonic_ns()
        out = preprocess(self, request, *args, **kwargs)
        if len(_arrived) < _MAX:
            _arrived[request.request_id] = t
        return out

    return wrapper


def _stamp_scheduled(add_request):
    @functools.wraps(add_request)
    def wrapper(self, request, *args, **kwargs):
        t_in = _arrived.pop(request.request_id, None)
        if t_in is not None:
            from hotloop.vllm import engine_loop

            _waits.append((request.request_id, (time.monotonic_ns() - t_in) / 1e3, engine_loop.in_step()))
        return add_request(self, request, *args, **kwargs)

    return wrapper


def queue_waits(self=None) -> dict:
    """The waits recorded since the last call (and forget them); a utility method of vLLM's EngineCore."""
    got = [_waits.popleft() for _ in range(len(_waits))]
    return {"request_ids": [r for r, _, _ in got], "waits_us": [w for _, w, _ in got],
            "during_step": [s for _, _, s in got]}


def install() -> None:
    """Stamp requests in this process's engine core (idempotent)."""
    import importlib

    core = importlib.import_module(_ENGINE_CORE).EngineCore
    if _saved:
        return
    for attr, new in (("preprocess_add_request", _stamp_arrival(core.__dict__["preprocess_add_request"])),
                      ("add_request", _stamp_scheduled(core.__dict__["add_request"])),
                      ("hotloop_queue_waits", queue_waits)):
        _saved[attr] = core.__dict__.get(attr, _saved)
        setattr(core, attr, new)


def uninstall() -> None:
    import sys

    mod = sys.modules.get(_ENGINE_CORE)
    for attr, old in _saved.items():
        if old is _saved:
            delattr(mod.EngineCore, attr)
        else:
            setattr(mod.EngineCore, attr, old)
    _saved.clear()


__all__ = ["install", "queue_waits", "uninstall"]
