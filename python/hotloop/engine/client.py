"""Engine clients: ``EngineClient`` (blocking) and ``AsyncEngineClient`` (asyncio). Each starts its own engine
process and talks to it over two ZeroMQ sockets (requests out, outputs in), msgpack-encoded.

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
import itertools
import multiprocessing as mp
import os
import tempfile
import uuid
from collections import deque

import zmq
import zmq.asyncio

from hotloop.engine import tokenizer
from hotloop.engine.lifecycle import stop_processes
from hotloop.engine.model import model_config
from hotloop.engine.process import engine_main
from hotloop.engine.protocol import (AbortRequest, AddRequest, FinishReason, OutputBatch, RequestOutput, ShutdownRequest,
                                     StatsReport, StatsRequest, encoder, engine_decoder)
from hotloop.engine.scheduler import check_request
from hotloop.errors import EngineDeadError, RequestError, RequestTypeError

CTX = mp.get_context("spawn")


def _prompt_ids(prompt):
    """Token ids of a prompt (text is tokenized; ids are checked by check_request)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise RequestTypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    return prompt


def checked_request(model, request_id, prompt, max_tokens, stop_token_ids, temperature, seed,
                    ignore_eos) -> AddRequest:
    """The AddRequest a client sends for these arguments, checked against `model`'s vocabulary and length (raises
    RequestTypeError / RequestError; see the module contract)."""
    config = model_config(model)
    if stop_token_ids is None:
        stop_token_ids = ()
    return check_request(request_id, _prompt_ids(prompt), max_tokens, stop_token_ids, temperature, seed, ignore_eos,
                         vocab_size=config.vocab_size, max_model_len=config.max_seq_len)


class EngineProcess:
    """Starts the engine process and owns the client's end of its sockets."""

    def __init__(self, ctx: zmq.Context, engine_kwargs: dict, start_timeout: float, target=engine_main,
                 name: str = "hotloop-engine", async_outputs: bool = False):
        """Start `target(in_addr, out_addr, engine_kwargs, parent_pid, ready_conn)` in a new process (the
        engine's main, or another stage's with the same shape: it sends its pid on ready_conn when serving)."""
        self._dir = tempfile.mkdtemp(prefix=name + "-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.ctx = ctx
        # Requests: the process binds, this side connects once it is ready, so the pipe exists from then on and a
        # send never blocks (a bound PUSH with no peer would block, and an event loop with it).
        self.requests = ctx.socket(zmq.PUSH)
        self.requests.setsockopt(zmq.LINGER, 0)
        self.requests.setsockopt(zmq.SNDHWM, 0)
        # async_outputs: an asyncio socket that owns its handle (a shadow of a sync socket would leave the sync
        # object to close the handle a second time when it is collected)
        out_ctx = zmq.asyncio.Context.shadow(ctx.underlying) if async_outputs else ctx
        self.outputs = out_ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(out_addr)
        parent, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, name=name, daemon=False,
                                args=(in_addr, out_addr, engine_kwargs, os.getpid(), child))
        self.proc.start()
        child.close()
        import multiprocessing.connection as mpc

        try:
            ready = mpc.wait([parent, self.proc.sentinel], timeout=start_timeout)
            msg = parent.recv() if parent in ready else None
        except EOFError:
            msg = None
        finally:
            parent.close()
        if not isinstance(msg, int):
            self.stop(graceful=False)
            why = msg or f"exit code {self.proc.exitcode}" if self.proc.exitcode is not None else "no answer"
            raise EngineDeadError(f"the {name} process did not start ({why}); see its output above")
        self.requests.connect(in_addr)
        self.pid = msg
        self.dead = False
        self.dead_reason: str | None = None  # what the engine said when its executor failed

    def send(self, msg) -> None:
        """Never blocks: a PUSH socket whose peer is gone would wait forever (and an event loop with it)."""
        try:
            self.requests.send(encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # not expected with an unlimited queue; never block instead
            raise EngineDeadError(f"the {self.proc.name} process (pid {self.proc.pid}) does not take requests; "
                                  "nothing sent to it will be answered") from None

    def abort_quietly(self, request_id: str) -> None:
        """Abort a request a caller left; nothing to do if the process is gone."""
        if not self.dead:
            try:
                self.send(AbortRequest([request_id]))
            except EngineDeadError:
                pass

    def death_message(self) -> str:
        if self.dead_reason:
            return self.dead_reason
        code = self.proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"the {self.proc.name} process (pid {self.proc.pid}) {how}"

    def stop(self, graceful: bool = True, close_outputs: bool = True) -> None:
        """Stop and reap the process. close_outputs=False: the caller closed the outputs socket itself (an
        asyncio socket shadowing it must be closed through the shadow, which also unhooks it from the loop)."""
        if graceful and self.proc.exitcode is None:
            try:
                self.send(ShutdownRequest())
            except (zmq.ZMQError, EngineDeadError):
                pass
        stop_processes([self.proc], grace_s=5 if graceful else 0, term_s=2)
        self.requests.close(0)
        if close_outputs:
            self.outputs.close(0)
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except FileNotFoundError:
                pass
        os.rmdir(self._dir)


class _Stream:
    def __init__(self):
        self.items: deque = deque()
        self.done = False


class EngineClient:
    """Blocking client; one thread uses it (iterators of several requests may be interleaved)."""

    def __init__(self, model="tiny", executor: str = "inprocess", tp: int = 1, wait_mode: str = "hotloop",
                 start_timeout: float = 120, **engine_kwargs):
        self._ctx = zmq.Context()
        self._engine = EngineProcess(self._ctx, dict(model=model, executor=executor, tp=tp, wait_mode=wait_mode,
                                                     **engine_kwargs), start_timeout)
        self._poller = zmq.Poller()
        self._poller.register(self._engine.outputs, zmq.POLLIN)
        self._poller.register(self._engine.proc.sentinel, zmq.POLLIN)
        self._model = model
        self._streams: dict[str, _Stream] = {}
        self._stats: deque = deque()
        self._ids = itertools.count()

    @property
    def engine_pid(self) -> int:
        return self._engine.pid

    def _check_alive(self):
        if self._engine.dead:
            raise EngineDeadError(self._engine.death_message())

    def _pump(self, timeout: float | None = None) -> None:
        """Wait for the next message from the engine (or its death) and route it."""
        self._check_alive()
        events = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        if self._engine.outputs in events:
            while True:
                try:
                    data = self._engine.outputs.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._route(engine_decoder.decode(data))
            return
        if self._engine.proc.sentinel in events:
            self._engine.proc.join(1)
            self._engine.dead = True
            raise EngineDeadError(self._engine.death_message())

    def _route(self, msg) -> None:
        if isinstance(msg, StatsReport):
            self._stats.append(msg)
            return
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.items.append(out)

    def generate(self, prompt, max_tokens: int = 16, stop_token_ids=(), temperature: float = 0.0, seed: int = 0,
                 ignore_eos: bool = False, request_id: str | None = None):
        """Stream the outputs of one request (see the module contract)."""
        self._check_alive()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        spec = checked_request(self._model, rid, prompt, max_tokens, stop_token_ids, temperature, seed, ignore_eos)
        if rid in self._streams:
            raise RequestError(f"request id {rid!r} is already streaming from this client")
        stream = self._streams[rid] = _Stream()
        try:
            self._engine.send(spec)
        except BaseException:
            del self._streams[rid]
            raise
        return self._iterate(rid, stream)

    def _iterate(self, rid: str, stream: _Stream):
        try:
            while True:
                while stream.items:
                    out = stream.items.popleft()
                    if out.finish_reason == FinishReason.ENGINE_DEAD:
                        stream.done = True
                        self._engine.dead, self._engine.dead_reason = True, out.error
                        raise EngineDeadError(out.error)
                    if out.error:
                        stream.done = True
                        raise RequestError(out.error)
                    if out.finished:
                        stream.done = True
                    yield out
                    if stream.done:
                        return
                self._pump()
        finally:
            self._streams.pop(rid, None)
            if not stream.done:
                self._engine.abort_quietly(rid)

    def abort(self, request_id: str) -> None:
        self._check_alive()
        self._engine.send(AbortRequest([request_id]))

    def stats(self, timeout: float = 10) -> StatsReport:
        self._check_alive()
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
        self._engine = await asyncio.to_thread(EngineProcess, self._ctx, kwargs, start_timeout, engine_main,
                                               "hotloop-engine", True)
        self._model = model
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: asyncio.Queue = asyncio.Queue()
        self._ids = itertools.count()
        self._dead_error: EngineDeadError | None = None
        loop = asyncio.get_running_loop()
        loop.add_reader(self._engine.proc.sentinel, self._on_engine_death)
        self._out = self._engine.outputs
        self._reader = asyncio.create_task(self._read_outputs(), name="hotloop-engine-outputs")
        self._reader.add_done_callback(self._on_reader_done)
        return self

    def _on_reader_done(self, task: asyncio.Task) -> None:
        """The output reader only ends by shutdown (cancelled); if it died, nothing would ever be answered: fail
        every waiting iterator and every later call instead of leaving them waiting."""
        if task.cancelled() or task.exception() is None or self._dead_error is not None:
            return
        self._dead_error = EngineDeadError(f"the client stopped reading the engine's outputs: "
                                           f"{task.exception()!r}; start a new client")
        for q in self._queues.values():
            q.put_nowait(self._dead_error)
        self._stats.put_nowait(self._dead_error)

    @property
    def engine_pid(self) -> int:
        return self._engine.pid

    async def _read_outputs(self):
        sock = self._out
        while True:
            msg = engine_decoder.decode(await sock.recv())
            if isinstance(msg, StatsReport):
                self._stats.put_nowait(msg)
                continue
            for out in msg.outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)

    def _on_engine_death(self):
        asyncio.get_running_loop().remove_reader(self._engine.proc.sentinel)
        self._engine.proc.join(1)
        self._engine.dead = True
        self._dead_error = EngineDeadError(self._engine.death_message())
        for q in self._queues.values():
            q.put_nowait(self._dead_error)
        self._stats.put_nowait(self._dead_error)

    def _check_alive(self):
        if self._dead_error is not None:
            raise self._dead_error

    async def generate(self, prompt, max_tokens: int = 16, stop_token_ids=(), temperature: float = 0.0,
                       seed: int = 0, ignore_eos: bool = False, request_id: str | None = None):
        """Async iterator of one request's outputs (see the module contract)."""
        self._check_alive()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        spec = checked_request(self._model, rid, prompt, max_tokens, stop_token_ids, temperature, seed, ignore_eos)
        if rid in self._queues:
            raise RequestError(f"request id {rid!r} is already streaming from this client")
        q = self._queues[rid] = asyncio.Queue()
        done = False
        try:
            self._engine.send(spec)
            while not done:
                out = await q.get()
                if isinstance(out, EngineDeadError):
                    done = True
                    raise out
                if out.finish_reason == FinishReason.ENGINE_DEAD:
                    done = True
                    raise EngineDeadError(out.error)
                if out.error:
                    done = True
                    raise RequestError(out.error)
                done = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not done and self._engine is not None:
                self._engine.abort_quietly(rid)

    async def abort(self, request_id: str) -> None:
        self._check_alive()
        self._engine.send(AbortRequest([request_id]))

    async def stats(self) -> StatsReport:
        self._check_alive()
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
