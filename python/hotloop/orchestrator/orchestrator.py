"""Orchestrator: routes a request through a pipeline of stages (LLM engines, transform processes) and streams the
last stage's packets to the caller. Event-driven by default; the legacy poll loop is kept as an explicit A/B
baseline.

Contract:
- ``await Orchestrator.start(stages, loop=None)``; ``loop`` is "event" or "poll", or None to read
  ``$HOTLOOP_ORCHESTRATOR_EVENT_DRIVEN`` (1/true/yes/on: event, 0/false/no/off: poll, any case; unset: event).
- ``generate(prompt, max_tokens)`` is an async iterator of ``Packet`` from the last stage (tokens of an LLM stage,
  float32 frames of a transform stage); the last packet has ``finished`` and a ``finish_reason``, and a request
  ends exactly once. A stage forwards whole outputs to the next one, or (``stream_chunk_tokens`` on an LLM stage
  feeding a transform) every N tokens as they come. Each request is bound to one replica per stage (least
  in-flight, round-robin among equals) for the rest of that stage.
- Event loop: one reader task per live replica awaits its output batches and puts them on one dispatch queue,
  which one task consumes serially; the poll loop scans every replica with a 1 ms timeout and sleeps 1 ms when
  idle. Both hand each batch to the same ``_handle_batch`` and each death to the same ``_evict``.
- Readers are reconciled with the live replicas at once when membership changes (``add_replica``,
  ``remove_replica``, ``swap_replica``) and every RECONCILE_INTERVAL_S (2 s) of wall-clock time as a safety net; a reader that ended
  (its replica died) is not restarted against the dead replica.
- A replica that dies is evicted: only requests bound to it fail (ReplicaDeadError to their callers), and a stage
  left without replicas fails the requests that reach it; the orchestrator keeps serving. ``abort`` reaches only
  the stages and replicas holding the request; the caller gets what was produced and a final "abort" packet.
  ``shutdown`` cancels and awaits every task and shuts each replica down once.
- ``generate`` checks a request before anything is sent or registered (an LLM first stage: the engine clients'
  ``check_request`` against the stage's model, and only the sampling parameters ``stop_token_ids``,
  ``temperature``, ``seed``, ``ignore_eos``; a transform first stage: token ids in its vocabulary, no sampling
  parameters): an invalid one raises RequestTypeError (a TypeError) or RequestError (a ValueError).
- ``on_stats(stage, replica, StatsReport)`` receives stats-only batches; if it raises, the error is logged once per
  exception type (``monitor.callback_errors`` counts every one) and the batch's requests are handled as usual.
  ``monitor`` counts loop idle/active turns (not comparable across loops: the poll loop counts scans, the event
  loop counts dispatches), the dispatch queue's high water mark, evictions, and in-flight requests and output
  batches per replica; hotloop.metrics exports them (``component="orchestrator"``, ``loop``, ``stage``,
  ``replica`` labels) until ``shutdown``.
- Never hangs: if the dispatch task, the poll loop, a reader or the reconcile schedule dies of an unexpected
  exception (a bug, not a replica's death: that is an eviction), the orchestrator is broken. It is not restarted
  (its state may be inconsistent): every pending request fails at once with OrchestratorBrokenError naming the
  exception, the other loop tasks stop, and every later ``generate`` raises OrchestratorBrokenError; ``broken``
  says why. ``shutdown`` still reaps every replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from dataclasses import dataclass, field

from hotloop import metrics
from hotloop.engine import tokenizer
from hotloop.engine.client_core import checked_request
from hotloop.engine.protocol import AddRequest, FinishReason
from hotloop.engine.scheduler import check_token_ids
from hotloop.errors import OrchestratorBrokenError, ReplicaDeadError, RequestError, RequestTypeError
from hotloop.orchestrator.packet import Packet
from hotloop.orchestrator.replica import Batch, Replica
from hotloop.orchestrator.vocoder import TransformChunk

ENV_EVENT_DRIVEN = "HOTLOOP_ORCHESTRATOR_EVENT_DRIVEN"
# The safety-net schedule. Each wake of an idle event loop costs ~0.4 ms of CPU on a small VM (measured: 0.078 %
# of a core idle at 0.5 s, 0.023 % at 2 s, 0.003 % without it), and membership changes made through the API
# reconcile at once anyway, so the schedule only has to catch changes made behind the API's back.
RECONCILE_INTERVAL_S = 2.0
_log = logging.getLogger("hotloop.orchestrator")


SAMPLING_PARAMETERS = ("stop_token_ids", "temperature", "seed", "ignore_eos")


def loop_from_env(value: str | None) -> str:
    if value is None or not value.strip():
        return "event"
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return "event"
    if v in ("0", "false", "no", "off"):
        return "poll"
    raise ValueError(f"${ENV_EVENT_DRIVEN}={value!r}: use 1/true/yes/on (event loop) or 0/false/no/off (poll loop)")


@dataclass
class StageSpec:
    kind: str  # "llm" or "transform"
    replicas: int = 1
    name: str = ""
    options: dict = field(default_factory=dict)  # EngineCore arguments (llm) or Vocoder arguments (transform)
    max_tokens: int = 16  # an LLM stage after the first: tokens it generates from the previous stage's output
    stream_chunk_tokens: int | None = None  # an LLM stage feeding a transform: forward every N tokens


@dataclass
class _Stage:
    spec: StageSpec
    index: int
    replicas: list[Replica] = field(default_factory=list)
    rr: int = 0


@dataclass
class _Request:
    rid: str
    out: asyncio.Queue
    bound: dict[int, Replica] = field(default_factory=dict)  # stage -> replica, while the stage works on it
    buffer: list[int] = field(default_factory=list)  # tokens not yet forwarded
    done: bool = False


@dataclass
class Monitor:
    loop_idle: int = 0
    loop_active: int = 0
    dispatch_high_water: int = 0
    evictions: int = 0
    stats_batches: int = 0
    callback_errors: int = 0  # on_stats calls that raised
    finished_only_outputs: int = 0
    inflight: dict[str, int] = field(default_factory=dict)  # replica name -> requests bound to it
    batches: dict[str, int] = field(default_factory=dict)  # replica name -> output batches received


class Orchestrator:
    def __init__(self, stages: list[StageSpec], loop: str | None = None):
        self.loop = loop if loop is not None else loop_from_env(os.environ.get(ENV_EVENT_DRIVEN))
        if self.loop not in ("event", "poll"):
            raise ValueError(f"loop must be 'event' or 'poll', got {self.loop!r}")
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.stages = [_Stage(s, i) for i, s in enumerate(stages)]
        self.monitor = Monitor()
        self.on_stats = None  # callable(stage_index, replica, StatsReport)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._dispatch: asyncio.Queue = asyncio.Queue()
        self._readers: dict[Replica, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._shut: set[Replica] = set()
        self._names = itertools.count()
        self._closed = False
        self.broken: OrchestratorBrokenError | None = None  # set when one of its tasks died (see the contract)
        self._logged_callback_errors: set[str] = set()
        self._metrics = metrics.register(self._metrics_series, component="orchestrator", loop=self.loop)

    @classmethod
    async def start(cls, stages: list[StageSpec], loop: str | None = None) -> "Orchestrator":
        self = cls(stages, loop)
        try:
            starts = [self._new_replica(st) for st in self.stages for _ in range(st.spec.replicas)]
            for st, r in zip([st for st in self.stages for _ in range(st.spec.replicas)], await asyncio.gather(*starts)):
                st.replicas.append(r)
        except BaseException:
            await self.shutdown()
            raise
        if self.loop == "event":
            self._tasks.append(self._guarded(self._event_loop(), "hotloop-orch-dispatch"))
            self._tasks.append(self._guarded(self._reconcile_schedule(), "hotloop-orch-reconcile"))
            self._reconcile()
        else:
            self._tasks.append(self._guarded(self._poll_loop(), "hotloop-orch-poll"))
        return self

    # ---- task failures (see the contract: the orchestrator breaks, nothing hangs) ----

    def _guarded(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here, so asyncio does not warn about it again
        if exc is None or self._closed:
            return  # a reader ends normally after reporting its replica's death
        self._break(task.get_name(), exc)

    def _break(self, task_name: str, exc: BaseException) -> None:
        if self.broken is not None:
            return
        _log.error("orchestrator: its task %s died of %r; failing every pending request (the orchestrator is "
                   "broken: shut it down and start a new one)", task_name, exc, exc_info=exc)
        self.broken = OrchestratorBrokenError(f"the orchestrator is broken: its task {task_name} died of {exc!r}; "
                                              "shut it down and start a new one")
        for req in list(self._requests.values()):
            error = OrchestratorBrokenError(f"request {req.rid}: {self.broken}")
            try:
                self._end(req, error=error)
            except Exception:  # telling its replicas failed: the caller must still hear of it
                _log.exception("orchestrator: ending request %s after the failure raised", req.rid)
                if not req.done:
                    req.done = True
                    req.out.put_nowait(error)
                self._requests.pop(req.rid, None)
        for t in self._tasks[:] + list(self._readers.values()):
            if not t.done() and not t.get_name().startswith("hotloop-orch-reap-"):
                t.cancel()  # awaited by shutdown

    async def _new_replica(self, stage: _Stage) -> Replica:
        name = f"{stage.spec.name or stage.spec.kind}{stage.index}-r{next(self._names)}"
        return await Replica.start(stage.spec.kind, name, **stage.spec.options)

    # ---- membership ----

    async def add_replica(self, stage_index: int, replica: Replica | None = None) -> Replica:
        stage = self.stages[stage_index]
        replica = replica or await self._new_replica(stage)
        stage.replicas.append(replica)
        self._reconcile()
        return replica

    async def remove_replica(self, stage_index: int, replica: Replica) -> None:
        """Take a replica out (its bound requests fail) and shut it down."""
        self._evict(stage_index, replica, "removed from the pipeline")

    def swap_replica(self, stage_index: int, old: Replica, new: Replica) -> None:
        """Replace a replica's client in place; its reader is replaced at once."""
        reps = self.stages[stage_index].replicas
        reps[reps.index(old)] = new
        for req in self._requests.values():
            if req.bound.get(stage_index) is old:
                req.bound[stage_index] = new
        self._reconcile()

    def _reconcile(self) -> None:
        if self.loop != "event" or self._closed or self.broken is not None:
            return
        live = {r for st in self.stages for r in st.replicas}
        for r, task in list(self._readers.items()):
            if r not in live:
                task.cancel()
                del self._readers[r]
        for st in self.stages:
            for r in st.replicas:
                if r not in self._readers:  # a reader that ended stays ended: eviction removes its replica
                    self._readers[r] = self._guarded(self._reader(st.index, r), f"hotloop-orch-{r.name}")

    async def _reconcile_schedule(self):
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            self._reconcile()

    # ---- the loops ----

    async def _reader(self, stage_index: int, replica: Replica):
        while True:
            try:
                batch = await replica.read_batch()
            except ReplicaDeadError as e:
                self._put(("dead", stage_index, replica, str(e)))
                return
            except Exception as e:  # its socket failed: attributable to this replica
                self._put(("dead", stage_index, replica, f"reading its output failed: {e!r}"))
                return
            self._put(("batch", stage_index, replica, batch))

    def _put(self, item) -> None:
        self._dispatch.put_nowait(item)
        self.monitor.dispatch_high_water = max(self.monitor.dispatch_high_water, self._dispatch.qsize())

    async def _event_loop(self):
        while True:
            if self._dispatch.empty():
                self.monitor.loop_idle += 1
            kind, stage_index, replica, payload = await self._dispatch.get()
            self.monitor.loop_active += 1
            if kind == "batch":
                self._handle_batch(stage_index, replica, payload)
            else:
                self._evict(stage_index, replica, payload)

    async def _poll_loop(self):
        while True:
            progressed = False
            for st in self.stages:
                for replica in list(st.replicas):
                    if replica not in st.replicas:
                        continue  # evicted or swapped out during this scan
                    try:
                        batch = await replica.read_batch(timeout=0.001)
                        if batch is None:
                            continue
                    except ReplicaDeadError as e:
                        self._evict(st.index, replica, str(e))
                    except Exception as e:  # its socket failed: attributable to this replica
                        self._evict(st.index, replica, f"reading its output failed: {e!r}")
                    else:
                        self._handle_batch(st.index, replica, batch)
                    progressed = True
            if progressed:
                self.monitor.loop_active += 1
            else:
                self.monitor.loop_idle += 1
                await asyncio.sleep(0.001)  # the legacy poll loop's idle sleep (A/B baseline)

    # ---- per-batch handling (both loops) ----

    def _handle_batch(self, stage_index: int, replica: Replica, batch: Batch) -> None:
        self.monitor.batches[replica.name] = self.monitor.batches.get(replica.name, 0) + 1
        if batch.stats is not None:
            self.monitor.stats_batches += 1
            if self.on_stats:
                try:
                    self.on_stats(stage_index, replica, batch.stats)
                except Exception as e:  # the caller's callback: its failure is not the requests'
                    self.monitor.callback_errors += 1
                    kind = type(e).__name__
                    if kind not in self._logged_callback_errors:
                        self._logged_callback_errors.add(kind)
                        _log.error("orchestrator: on_stats raised %r (logged once per exception type; "
                                   "monitor.callback_errors counts them all); requests are not affected", e,
                                   exc_info=e)
        for out in batch.outputs:
            req = self._requests.get(out.request_id)
            if req is None or req.done:
                continue  # a request that already ended (e.g. an abort's echo from another stage)
            if out.finished and not out.tokens and not out.frames:
                self.monitor.finished_only_outputs += 1
            try:
                self._advance(req, stage_index, out)
            except Exception as e:  # not attributable to a replica: fail this request only, evict nothing
                _log.exception("orchestrator: handling output of request %s failed", req.rid)
                self._end(req, error=RuntimeError(f"request {req.rid}: the orchestrator failed to route an output: {e!r}"))

    def _advance(self, req: _Request, si: int, out: Packet) -> None:
        stage = self.stages[si]
        if out.error or out.finish_reason == FinishReason.ENGINE_DEAD:
            self._end(req, error=RequestError(f"request {req.rid} failed in stage {si}: {out.error}"))
            return
        if out.finish_reason == FinishReason.ABORT:
            self._end(req, Packet(req.rid, finished=True, finish_reason=FinishReason.ABORT))
            return
        if out.finished:
            self._unbind(req, si)
        last = si == len(self.stages) - 1
        if last:
            self._deliver(req, Packet(req.rid, out.tokens, out.frames, out.finished, out.finish_reason))
            if out.finished:
                self._end(req)
            return
        nxt = self.stages[si + 1]
        req.buffer += out.tokens or []
        chunk = stage.spec.stream_chunk_tokens if nxt.spec.kind == "transform" else None
        if chunk and (len(req.buffer) >= chunk or out.finished):
            while len(req.buffer) >= chunk or (out.finished and req.buffer is not None):
                part, req.buffer = req.buffer[:chunk], req.buffer[chunk:]
                final = out.finished and not req.buffer
                self._forward(req, nxt, TransformChunk(req.rid, part, final))
                if final or req.done:
                    break
        elif out.finished:
            tokens, req.buffer = req.buffer, []
            if nxt.spec.kind == "transform":
                self._forward(req, nxt, TransformChunk(req.rid, tokens, True))
            else:
                self._forward(req, nxt, AddRequest(req.rid, tokens, nxt.spec.max_tokens))

    def _forward(self, req: _Request, stage: _Stage, message) -> None:
        replica = req.bound.get(stage.index)
        if replica is None:
            replica = self._route(stage)
            if replica is None:
                self._end(req, error=ReplicaDeadError(f"request {req.rid}: stage {stage.index} "
                                                      f"({stage.spec.kind}) has no live replica"))
                return
            req.bound[stage.index] = replica
            self.monitor.inflight[replica.name] = self.monitor.inflight.get(replica.name, 0) + 1
        try:
            replica.submit(message)
        except ReplicaDeadError as e:
            self._end(req, error=e)

    def _route(self, stage: _Stage) -> Replica | None:
        live = [r for r in stage.replicas if r.alive]
        if not live:
            return None
        n = len(live)
        order = [live[(stage.rr + i) % n] for i in range(n)]
        stage.rr = (stage.rr + 1) % n
        return min(order, key=lambda r: self.monitor.inflight.get(r.name, 0))

    def _unbind(self, req: _Request, si: int) -> None:
        r = req.bound.pop(si, None)
        if r is not None:
            self.monitor.inflight[r.name] -= 1

    def _deliver(self, req: _Request, packet: Packet) -> None:
        req.out.put_nowait(packet)

    def _end(self, req: _Request, packet: Packet | None = None, error: BaseException | None = None) -> None:
        """The request's single terminal event: a final packet, an error, or (packet None) already delivered."""
        if req.done:
            return
        req.done = True
        for si in list(req.bound):
            replica = req.bound[si]
            if error is not None or (packet is not None and packet.finish_reason == FinishReason.ABORT):
                replica.abort(req.rid)  # stop work still running for it in other stages
            self._unbind(req, si)
        if error is not None:
            req.out.put_nowait(error)
        elif packet is not None:
            req.out.put_nowait(packet)
        self._requests.pop(req.rid, None)

    def _evict(self, stage_index: int, replica: Replica, why: str) -> None:
        stage = self.stages[stage_index]
        if replica not in stage.replicas:
            return  # already evicted
        stage.replicas.remove(replica)
        self.monitor.evictions += 1
        task = self._readers.pop(replica, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        for req in list(self._requests.values()):
            if req.bound.get(stage_index) is replica:
                req.bound.pop(stage_index)
                self.monitor.inflight[replica.name] -= 1
                self._end(req, error=ReplicaDeadError(f"request {req.rid}: replica {replica.name} of stage "
                                                      f"{stage_index} failed: {why}"))
        self._spawn_shutdown(replica)
        self._reconcile()

    def _spawn_shutdown(self, replica: Replica) -> None:
        if replica in self._shut:
            return
        self._shut.add(replica)
        self._tasks.append(asyncio.create_task(replica.shutdown(), name=f"hotloop-orch-reap-{replica.name}"))

    # ---- API ----

    async def generate(self, prompt, max_tokens: int = 16, request_id: str | None = None, **sampling):
        """Async iterator of the last stage's packets for one request (see the module contract)."""
        if self._closed:
            raise RuntimeError("the orchestrator is shut down")
        if self.broken is not None:
            raise OrchestratorBrokenError(str(self.broken))
        rid = request_id if request_id is not None else f"orq-{next(self._ids)}"
        message = self._first_message(rid, prompt, max_tokens, sampling)
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in the pipeline")
        req = self._requests[rid] = _Request(rid, asyncio.Queue())
        self._forward(req, self.stages[0], message)
        finished = False
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and not req.done:
                self.abort(rid)

    def _first_message(self, rid, prompt, max_tokens, sampling: dict):
        """The checked message for the first stage (see the contract); raises before anything is registered."""
        first = self.stages[0]
        if first.spec.kind == "llm":
            unknown = sorted(set(sampling) - set(SAMPLING_PARAMETERS))
            if unknown:
                raise RequestTypeError(f"unknown sampling parameters {unknown}; an LLM stage takes "
                                       f"{', '.join(SAMPLING_PARAMETERS)}")
            return checked_request(first.spec.options.get("model", "tiny"), rid, prompt, max_tokens,
                                   sampling.get("stop_token_ids", ()), sampling.get("temperature", 0.0),
                                   sampling.get("seed", 0), sampling.get("ignore_eos", False))
        if sampling:
            raise RequestTypeError(f"a transform first stage takes no sampling parameters, got {sorted(sampling)}")
        if not isinstance(rid, str):
            raise RequestTypeError(f"request_id must be a str, got {type(rid).__name__} {rid!r}")
        if isinstance(prompt, str):
            prompt = tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
            raise RequestTypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        ids = check_token_ids(f"request {rid!r}: ", "prompt token ids", prompt,
                              first.spec.options.get("vocab", tokenizer.VOCAB_SIZE))
        return TransformChunk(rid, ids, True)

    def abort(self, request_id: str) -> None:
        """End a request: only the stages and replicas holding it are told."""
        req = self._requests.get(request_id)
        if req is not None:
            self._end(req, Packet(request_id, finished=True, finish_reason=FinishReason.ABORT))

    def _metrics_series(self) -> list:
        """hotloop.metrics: per live replica (stage, replica labels) and for the whole orchestrator."""
        m = self.monitor
        out = [({"stage": st.index, "replica": r.name},
                {"counters": {"orchestrator_batches": m.batches.get(r.name, 0)},
                 "gauges": {"orchestrator_inflight_requests": m.inflight.get(r.name, 0)}})
               for st in self.stages for r in st.replicas]
        out.append(({}, {"counters": {"orchestrator_evictions": m.evictions, "orchestrator_loop_turns_active":
                                      m.loop_active, "orchestrator_loop_turns_idle": m.loop_idle},
                         "gauges": {"orchestrator_dispatch_queue_high_water": m.dispatch_high_water}}))
        return out

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        metrics.unregister(self._metrics)
        for req in list(self._requests.values()):
            self._end(req, error=RuntimeError(f"request {req.rid}: the orchestrator shut down"))
        loops = self._tasks[:] + list(self._readers.values())
        for t in loops:
            if not t.get_name().startswith("hotloop-orch-reap-"):
                t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        self._readers.clear()
        for st in self.stages:
            for r in st.replicas:
                if r not in self._shut:
                    self._shut.add(r)
                    await r.shutdown()
        self._tasks.clear()
