"""Engine clients: ``EngineClient`` (blocking) and ``AsyncEngineClient`` (asyncio). Each starts its own engine
process (a StageProcess: two ZeroMQ sockets, msgpack-encoded) and keeps its requests' streams in a ClientCore
(client_core.py: request checks and ids, routing, outcomes), so the two differ only in how they wait.

Contract: ``generate(prompt or token ids, max_tokens, ...)`` returns an (async) iterator of RequestOutput, one per
generated token (the last has ``finished`` and a ``finish_reason``); a request the engine rejects raises
RequestError from the iterator, other requests are unaffected. Every request is checked before it is sent
(``scheduler.check_request``: types, token ids in the model's vocabulary, max_tokens >= 1 within the model's length,
a finite temperature >= 0, below 1e-5 greedy): an invalid one raises RequestTypeError (a TypeError) or RequestError
(a ValueError) naming the field and what is allowed, from ``generate`` itself (the sync client) or the iterator's
first step (the async one); nothing is sent and the client stays usable. Leaving an iterator early aborts its request.
``abort(request_id)`` ends a request (its iterator ends with finish_reason "abort"). If the engine process dies
or its executor fails (a worker died), every waiting iterator and every later call raises EngineDeadError within
milliseconds (the client waits on the
process sentinel together with its socket: no polling timer). ``shutdown()`` stops the engine and reaps it.
"""

from __future__ import annotations

import asyncio
from collections import deque

import zmq

from hotloop.engine.client_core import ClientCore
from hotloop.engine.engine_process import engine_main
from hotloop.engine.protocol import AbortRequest, RequestOutput, StatsReport, StatsRequest, engine_decoder
from hotloop.errors import EngineDeadError
from hotloop.stage_process.stage import StageProcess


class EngineClient:
    """Blocking client; one thread uses it (iterators of several requests may be interleaved)."""

    def __init__(self, model="tiny", executor: str = "inprocess", tp: int = 1, wait_mode: str = "hotloop",
                 start_timeout: float = 120, **engine_kwargs):
        self._ctx = zmq.Context()
        self._engine = StageProcess(self._ctx, engine_main, dict(model=model, executor=executor, tp=tp,
                                                                 wait_mode=wait_mode, **engine_kwargs),
                                    start_timeout, "hotloop-engine")
        self._poller = zmq.Poller()
        self._poller.register(self._engine.outputs, zmq.POLLIN)
        self._poller.register(self._engine.proc.sentinel, zmq.POLLIN)
        self._core = ClientCore(model)
        self._stats: deque = deque()

    @property
    def engine_pid(self) -> int:
        return self._engine.pid

    def _pump(self, timeout: float | None = None) -> None:
        """Wait for the next message from the engine (or its death) and route it."""
        self._core.check_alive()
        events = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        if self._engine.outputs in events:
            while True:
                try:
                    data = self._engine.outputs.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                stats = self._core.route(engine_decoder.decode(data))
                if stats is not None:
                    self._stats.append(stats)
            return
        if self._engine.proc.sentinel in events:
            self._engine.proc.join(1)
            self._engine.dead = True
            raise self._core.engine_died(self._engine.death_message())

    def generate(self, prompt, max_tokens: int = 16, stop_token_ids=(), temperature: float = 0.0, seed: int = 0,
                 ignore_eos: bool = False, request_id: str | None = None):
        """Stream the outputs of one request (see the module contract)."""
        items: deque = deque()
        spec = self._core.add(items.append, prompt, max_tokens, stop_token_ids, temperature, seed, ignore_eos,
                              request_id)
        try:
            self._engine.send(spec)
        except BaseException:
            self._core.remove(spec.request_id)
            raise
        return self._iterate(spec.request_id, items)

    def _iterate(self, rid: str, items: deque):
        done = False
        try:
            while True:
                while items:
                    out = items.popleft()
                    try:
                        done = self._core.outcome(out)
                    except EngineDeadError:
                        done = self._engine.dead = True
                        raise
                    except Exception:
                        done = True
                        raise
                    yield out
                    if done:
                        return
                self._pump()
        finally:
            self._core.remove(rid)
            if not done:
                self._engine.abort_quietly(rid)

    def abort(self, request_id: str) -> None:
        self._core.check_alive()
        self._engine.send(AbortRequest([request_id]))

    def stats(self, timeout: float = 10) -> StatsReport:
        self._core.check_alive()
        self._engine.send(StatsRequest())
        while not self._stats:
            self._pump(timeout)
        return self._stats.popleft()

    def shutdown(self) -> None:
        if self._engine is None:
            return
        self._engine.stop(graceful=not self._engine.dead)
        self._engine = None
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False


class AsyncEngineClient:
    """asyncio client. Create it inside a running event loop (``await AsyncEngineClient.start(...)``)."""

    @classmethod
    async def start(cls, model="tiny", executor: str = "inprocess", tp: int = 1, wait_mode: str = "hotloop",
                    start_timeout: float = 120, **engine_kwargs) -> "AsyncEngineClient":
        self = cls()
        self._ctx = zmq.Context()  # requests go out with plain non-blocking sends; outputs are awaited
        kwargs = dict(model=model, executor=executor, tp=tp, wait_mode=wait_mode, **engine_kwargs)
        self._engine = await asyncio.to_thread(StageProcess, self._ctx, engine_main, kwargs, start_timeout,
                                               "hotloop-engine", True)
        self._core = ClientCore(model)
        self._stats: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._engine.proc.sentinel, self._on_engine_death)
        self._out = self._engine.outputs
        self._reader = asyncio.create_task(self._read_outputs(), name="hotloop-engine-outputs")
        self._reader.add_done_callback(self._on_reader_done)
        return self

    def _fail_all(self, why: str) -> None:
        """The engine is gone (or unreadable): every waiting iterator and every later call raises."""
        if self._core.dead is not None:
            return
        error = self._core.engine_died(why)
        for sink in self._core.streams.values():
            sink(error)
        self._stats.put_nowait(error)

    def _on_reader_done(self, task: asyncio.Task) -> None:
        """The output reader only ends by shutdown (cancelled); if it died, nothing would ever be answered."""
        if task.cancelled() or task.exception() is None:
            return
        self._fail_all(f"the client stopped reading the engine's outputs: {task.exception()!r}; start a new client")

    @property
    def engine_pid(self) -> int:
        return self._engine.pid

    async def _read_outputs(self):
        sock = self._out
        while True:
            stats = self._core.route(engine_decoder.decode(await sock.recv()))
            if stats is not None:
                self._stats.put_nowait(stats)

    def _on_engine_death(self):
        asyncio.get_running_loop().remove_reader(self._engine.proc.sentinel)
        self._engine.proc.join(1)
        self._engine.dead = True
        self._fail_all(self._engine.death_message())

    async def generate(self, prompt, max_tokens: int = 16, stop_token_ids=(), temperature: float = 0.0,
                       seed: int = 0, ignore_eos: bool = False, request_id: str | None = None):
        """Async iterator of one request's outputs (see the module contract)."""
        q: asyncio.Queue = asyncio.Queue()
        spec = self._core.add(q.put_nowait, prompt, max_tokens, stop_token_ids, temperature, seed, ignore_eos,
                              request_id)
        done = False
        try:
            self._engine.send(spec)
            while not done:
                out = await q.get()
                if isinstance(out, EngineDeadError):
                    done = True
                    raise out
                try:
                    done = self._core.outcome(out)
                except Exception:
                    done = True
                    raise
                yield out
        finally:
            self._core.remove(spec.request_id)
            if not done and self._engine is not None:
                self._engine.abort_quietly(spec.request_id)

    async def abort(self, request_id: str) -> None:
        self._core.check_alive()
        self._engine.send(AbortRequest([request_id]))

    async def stats(self) -> StatsReport:
        self._core.check_alive()
        self._engine.send(StatsRequest())
        msg = await self._stats.get()
        if isinstance(msg, EngineDeadError):
            raise msg
        return msg

    async def shutdown(self) -> None:
        if self._engine is None:
            return
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass
        if not self._engine.dead:
            asyncio.get_running_loop().remove_reader(self._engine.proc.sentinel)
        engine, self._engine = self._engine, None
        self._out.close(linger=0)
        await asyncio.to_thread(engine.stop, not engine.dead, False)
        self._ctx.term()


__all__ = ["AsyncEngineClient", "EngineClient", "EngineDeadError", "RequestOutput"]
