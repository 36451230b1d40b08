"""Where a vLLM request's time goes, hop by hop, on vLLM's own loop and queue and on hotloop's.

Contract:

- ``install()`` (the plugin calls it in every vLLM process when ``HOTLOOP_VLLM_TIMELINE`` is 1/true/yes/on, whether
  or not hotloop's queue is on, so every arm of a benchmark is measured the same way) wraps methods of vLLM's own
  classes with stamps of ``time.monotonic_ns()`` (CLOCK_MONOTONIC: one clock for every process of the machine):
  - engine core, per request: ``EngineCore.preprocess_add_request`` entry (the input thread has decoded the ADD:
    the request reached the engine core) and exit (it goes into the input queue next), and
    ``EngineCore.add_request`` (the main thread puts it into the scheduler; also whether that happened while a
    step ran, i.e. through hotloop's engine-core loop);
  - engine core, per step: ``MultiprocExecutor.execute_model`` and ``sample_tokens`` (the step, and its sampling
    call, broadcast to the workers), ``Scheduler.update_from_output`` entry (the step's answer has been read) and
    exit (its outputs are made; the output thread sends them next), and the new requests the step prefills;
  - the front end (AsyncLLM's process), per request: ``AsyncMPClient.add_request_async`` entry (the front end has
    made the request; it encodes and sends it to the engine core next);
  - each worker, per step: ``WorkerWrapperBase.execute_model`` and ``sample_tokens`` entry (the worker has read
    the broadcast) and exit (its answer goes out next). Steps are matched across processes by a number the
    engine core writes into the SchedulerOutput it broadcasts (``hotloop_step``).
  Cost: a few clock reads and list appends per request and per step; off, nothing is wrapped.
- Reading the stamps (each call returns what was recorded since the last and forgets it; at most 65536 records):
  ``call_utility_async("hotloop_timeline")`` on the engine core returns ``{"requests": {id: [arrived, scheduled,
  during_step, preprocessed]}, "steps": [[step, broadcast, sample_broadcast, response_read, outputs_made,
  [new request ids]]], "reader_chains": step_wait.chain_stats(), ...`` (hotloop's readers' chain counters since they
  attached; {} on vLLM's queue), "read_cpu": read_cpu.totals() (None unless HOTLOOP_VLLM_READ_CPU)}``;
  ``collective_rpc("hotloop_timeline")`` returns each worker's ``[[step, read, done, sample_read,
  sample_done]]`` (None where the call did not happen); ``call_utility_async("hotloop_queue_waits")`` returns the
  engine core's queue waits alone (``{"request_ids", "waits_us", "during_step"}``).
- ``hops(front_end, core, worker, sends)`` turns them, with the front end's own stamps (request id -> [submitted,
  first output]), into each request's time to first token split into the hops below (milliseconds); with
  ``sends`` (``front_end_sends()``, read in the front end's process) the first hop is also split in two, reported
  beside them: "front end: submit -> send" (the front end's own work on the request) and "send -> engine core"
  (encoding, ZeroMQ both ways, the engine core's read and decode).
"""

from __future__ import annotations

import collections
import functools
import re
import sys
import time

from hotloop.vllm import engine_loop
from hotloop.vllm.class_patches import ClassPatches

_MAX = 1 << 16  # records kept between two reads

HOPS = ("front end -> engine core", "engine core queue", "scheduler -> step broadcast", "broadcast -> worker read",
        "worker step", "step done -> response read", "response read -> outputs", "outputs -> front end")

_requests: dict[str, list] = {}  # request id -> [arrived ns, scheduled ns | None, during step, preprocessed ns]
_steps: collections.deque = collections.deque(maxlen=_MAX)  # engine core: one list per step
_by_output: dict[int, list] = {}  # id(SchedulerOutput) -> its step's list, until update_from_output
_worker_steps: collections.deque = collections.deque(maxlen=_MAX)
_sends: dict[str, int] = {}  # front end: request id -> when AsyncMPClient.add_request_async was called
_step_count = [0]
_patches = ClassPatches()
_parts: set[str] = set()  # what install() has stamped: "core", "client", "worker"


def _now() -> int:
    return time.monotonic_ns()


# ---- front end ----

def _stamp_send(add_request_async):
    @functools.wraps(add_request_async)
    async def wrapper(self, request, *args, **kwargs):
        if len(_sends) < _MAX:
            _sends[request.request_id] = _now()
        return await add_request_async(self, request, *args, **kwargs)

    return wrapper


def front_end_sends() -> dict[str, int]:
    """This process's send stamps since the last call (request id -> ns), forgotten once returned."""
    out = dict(_sends)
    _sends.clear()
    return out


# ---- engine core ----

def _stamp_arrival(preprocess):
    @functools.wraps(preprocess)
    def wrapper(self, request, *args, **kwargs):
        t = _now()
        out = preprocess(self, request, *args, **kwargs)
        if len(_requests) < _MAX:
            _requests[request.request_id] = [t, None, False, _now()]
        return out

    return wrapper


def _stamp_scheduled(add_request):
    @functools.wraps(add_request)
    def wrapper(self, request, *args, **kwargs):
        rec = _requests.get(request.request_id)
        if rec is not None and rec[1] is None:
            rec[1], rec[2] = _now(), engine_loop.in_step()
        return add_request(self, request, *args, **kwargs)

    return wrapper


def _stamp_broadcast(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        _step_count[0] += 1
        step = [_step_count[0], _now(), None, None, None, [r.req_id for r in scheduler_output.scheduled_new_reqs]]
        scheduler_output.hotloop_step = step[0]  # travels to the workers with the pickled SchedulerOutput
        _steps.append(step)
        _by_output[id(scheduler_output)] = step
        return execute_model(self, scheduler_output, *args, **kwargs)

    return wrapper


def _stamp_sample_broadcast(sample_tokens):
    @functools.wraps(sample_tokens)
    def wrapper(self, *args, **kwargs):
        if _steps and _steps[-1][2] is None:
            _steps[-1][2] = _now()
        return sample_tokens(self, *args, **kwargs)

    return wrapper


def _stamp_response(update_from_output):
    @functools.wraps(update_from_output)
    def wrapper(self, scheduler_output, *args, **kwargs):
        step = _by_output.pop(id(scheduler_output), None)
        if step is not None:
            step[3] = _now()
        out = update_from_output(self, scheduler_output, *args, **kwargs)
        if step is not None:
            step[4] = _now()
        return out

    return wrapper


def core_timeline(self=None) -> dict:
    """The engine core's records since the last call (a vLLM utility method of EngineCore)."""
    done = {rid: rec for rid, rec in list(_requests.items()) if rec[1] is not None}
    for rid in done:
        _requests.pop(rid, None)
    steps = []
    while _steps and _steps[0][3] is not None:  # steps answer in order: the answered ones come first
        steps.append(_steps.popleft())
    step_wait = sys.modules.get("hotloop.vllm.step_wait")  # hotloop's readers here: their chain counters so far
    read_cpu = sys.modules.get("hotloop.vllm.read_cpu")  # HOTLOOP_VLLM_READ_CPU: the reads' CPU so far
    return {"requests": done, "steps": steps, "reader_chains": step_wait.chain_stats() if step_wait else {},
            "read_cpu": read_cpu.totals() if read_cpu else None}


def queue_waits(self=None) -> dict:
    """The engine core's queue waits since the last call (a vLLM utility method of EngineCore); the requests'
    other stamps are dropped with them."""
    got = core_timeline()["requests"]
    return {"request_ids": list(got), "waits_us": [(r[1] - r[0]) / 1e3 for r in got.values()],
            "during_step": [r[2] for r in got.values()]}


# ---- workers ----

def _stamp_worker(method, read_at: int):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        t = _now()
        if read_at == 1:
            step = getattr(args[0] if args else kwargs.get("scheduler_output"), "hotloop_step", None)
            rec = [step, t, None, None, None]
            _worker_steps.append(rec)
        else:
            rec = _worker_steps[-1] if _worker_steps else [None] * 5
            rec[3] = t
        try:
            return method(self, *args, **kwargs)
        finally:
            rec[read_at + 1] = _now()

    return wrapper


def _worker_sample_tokens(self, *args, **kwargs):
    return self.worker.sample_tokens(*args, **kwargs)


def worker_timeline(self=None) -> list:
    """This worker's records since the last call (a method of vLLM's WorkerWrapperBase: collective_rpc)."""
    return [_worker_steps.popleft() for _ in range(len(_worker_steps))]


# ---- install ----

def install() -> list[str]:
    """Stamp what this process runs of vLLM (the engine core's classes, the front end's client, the workers'
    wrapper), where loaded. Idempotent per part: a part loaded after an earlier call is stamped by the next one.
    Returns which parts were stamped."""
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None and "core" not in _parts:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        ec, mpe = core.EngineCore, MultiprocExecutor
        _patches.set(ec, "preprocess_add_request", _stamp_arrival(ec.__dict__["preprocess_add_request"]))
        _patches.set(ec, "add_request", _stamp_scheduled(ec.__dict__["add_request"]))
        _patches.set(ec, "hotloop_timeline", core_timeline)
        _patches.set(ec, "hotloop_queue_waits", queue_waits)
        _patches.set(mpe, "execute_model", _stamp_broadcast(mpe.__dict__["execute_model"]))
        _patches.set(mpe, "sample_tokens", _stamp_sample_broadcast(mpe.__dict__["sample_tokens"]))
        _patches.set(Scheduler, "update_from_output", _stamp_response(Scheduler.__dict__["update_from_output"]))
        _parts.add("core")
    client = sys.modules.get("vllm.v1.engine.core_client")
    if client is not None and "client" not in _parts and "add_request_async" in client.AsyncMPClient.__dict__:
        amc = client.AsyncMPClient
        _patches.set(amc, "add_request_async", _stamp_send(amc.__dict__["add_request_async"]))
        _parts.add("client")
    worker = sys.modules.get("vllm.v1.worker.worker_base")
    if worker is not None and "worker" not in _parts:
        ww = worker.WorkerWrapperBase
        _patches.set(ww, "execute_model", _stamp_worker(ww.__dict__["execute_model"], 1))
        _patches.set(ww, "sample_tokens", _stamp_worker(ww.__dict__.get("sample_tokens", _worker_sample_tokens), 3))
        _patches.set(ww, "hotloop_timeline", worker_timeline)
        _parts.add("worker")
    return _patches.owners()


def uninstall() -> None:
    _patches.restore()
    _parts.clear()


# ---- reading ----

def _client_id(request_id: str) -> str:
    """The id the client gave: AsyncLLM appends "-" and 8 hex digits to make it unique inside the engine."""
    return request_id[:-9] if re.fullmatch(r".*-[0-9a-f]{8}", request_id) else request_id


SEND_HOPS = ("front end: submit -> send", "send -> engine core")  # the first hop's two parts, where sends are known


def hops(front_end: dict, core: dict, worker: list, sends: dict | None = None) -> dict[str, list[float]]:
    """Each request's time to first token split into HOPS (ms), for the requests found in all three records:
    front_end maps request id -> [submitted ns, first output ns] (the front end's own stamps), core is what
    hotloop_timeline returned from the engine core, worker the output rank's records; with sends (request id ->
    ns, front_end_sends()) also SEND_HOPS for the requests it has."""
    first_step = {}
    steps = {s[0]: s for s in core["steps"]}
    for s in core["steps"]:
        for rid in s[5]:
            first_step.setdefault(rid, s[0])
    by_step = {w[0]: w for w in worker if w[0] is not None}
    core_ids = {_client_id(rid): rid for rid in core["requests"]}
    out = {h: [] for h in HOPS}
    out["time to first token"] = []
    if sends:
        out.update({h: [] for h in SEND_HOPS})
    for rid, (submitted, first) in front_end.items():
        rid = core_ids.get(rid, rid)
        req, k = core["requests"].get(rid), first_step.get(rid)
        if req is None or k is None or k not in by_step:
            continue
        s, w = steps[k], by_step[k]
        done = w[4] if w[4] is not None else w[2]
        marks = [submitted, req[0], req[1], s[1], w[1], done, s[3], s[4], first]
        for h, a, b in zip(HOPS, marks, marks[1:]):
            out[h].append((b - a) / 1e6)
        out["time to first token"].append((first - submitted) / 1e6)
        sent = sends.get(rid) if sends else None
        if sent is not None:
            out[SEND_HOPS[0]].append((sent - submitted) / 1e6)
            out[SEND_HOPS[1]].append((req[0] - sent) / 1e6)
    return out


__all__ = ["HOPS", "SEND_HOPS", "core_timeline", "front_end_sends", "hops", "install", "queue_waits", "uninstall",
           "worker_timeline"]
