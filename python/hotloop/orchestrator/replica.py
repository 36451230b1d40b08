"""A stage replica as the orchestrator sees it: a process it sends requests to and whose output batches it awaits.

Contract: ``await Replica.start(kind, **kwargs)`` starts an LLM engine process (kind "llm", the hotloop engine)
or a transform process (kind "transform", the vocoder). ``submit(message)`` sends without blocking; ``abort``
sends an abort; ``await read_batch()`` returns the next ``Batch`` (outputs, and/or engine stats: a batch may
carry only stats or only a finished id, and is returned all the same). If the process dies, ``read_batch``
raises ReplicaDeadError (the process sentinel is awaited with the socket; no polling). A ``read_batch`` cancelled
with a timeout returns None and loses nothing: the receive it started is kept (never cancelled) for the next call. ``shutdown()`` stops
and reaps the process once (later calls do nothing).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import zmq

from hotloop.engine.engine_process import engine_main
from hotloop.engine.protocol import AbortRequest, OutputBatch, StatsReport, engine_decoder
from hotloop.errors import EngineDeadError, ReplicaDeadError
from hotloop.orchestrator import vocoder
from hotloop.orchestrator.packet import Packet
from hotloop.stage_process.stage import StageProcess


@dataclass
class Batch:
    outputs: list[Packet] = field(default_factory=list)
    stats: StatsReport | None = None


class Replica:
    def __init__(self):
        self.kind = ""
        self.name = ""
        self._proc: StageProcess | None = None
        self._recv: asyncio.Future | None = None
        self._death: asyncio.Future | None = None

    @classmethod
    async def start(cls, kind: str, name: str = "", start_timeout: float = 120, **kwargs) -> "Replica":
        self = cls()
        self.kind, self.name = kind, name or kind
        self._ctx = zmq.Context()
        if kind == "llm":
            self._proc = await asyncio.to_thread(StageProcess, self._ctx, engine_main, kwargs, start_timeout,
                                                 "hotloop-engine", True)
        elif kind == "transform":
            self._proc = await asyncio.to_thread(StageProcess, self._ctx, vocoder.transform_main, kwargs,
                                                 start_timeout, "hotloop-transform", True)
        else:
            raise ValueError(f"replica kind must be 'llm' or 'transform', got {kind!r}")
        self._sock = self._proc.outputs  # an asyncio socket
        loop = asyncio.get_running_loop()
        self._death = loop.create_future()
        loop.add_reader(self._proc.proc.sentinel, self._on_death)
        return self

    @property
    def pid(self) -> int:
        return self._proc.proc.pid

    @property
    def alive(self) -> bool:
        return self._death is not None and not self._death.done() and self._proc is not None

    def _on_death(self):
        asyncio.get_running_loop().remove_reader(self._proc.proc.sentinel)
        self._proc.proc.join(1)
        self._proc.dead = True
        if not self._death.done():
            self._death.set_result(self._proc.death_message())

    def submit(self, message) -> None:
        """Send without blocking; ReplicaDeadError if the process is gone (even before its death is seen)."""
        if not self.alive:
            raise ReplicaDeadError(f"replica {self.name} is not running")
        try:
            self._proc.send(message)
        except EngineDeadError as e:
            raise ReplicaDeadError(f"replica {self.name}: {e}") from None

    def abort(self, request_id: str) -> None:
        """Best effort: a replica that is gone has nothing to abort."""
        if self.alive:
            try:
                self._proc.send(AbortRequest([request_id]))
            except EngineDeadError:
                pass

    async def read_batch(self, timeout: float | None = None) -> Batch | None:
        """The next batch; None if `timeout` seconds pass first (nothing is cancelled then: the receive stays
        pending for the next call). ReplicaDeadError once the process died (after every batch it sent) or was
        shut down."""
        if self._recv is None:
            if self._proc is None:
                raise ReplicaDeadError(f"replica {self.name} was shut down")
            self._recv = asyncio.ensure_future(self._sock.recv())
        recv = self._recv
        if not recv.done():
            await asyncio.wait({recv, self._death}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if recv.done():
            self._recv = None
            if recv.cancelled():  # shutdown() cancelled it
                raise ReplicaDeadError(f"replica {self.name} was shut down")
            return self._decode(recv.result())
        if self._death.done():  # only the death completed: every output it sent was read before
            raise ReplicaDeadError(f"replica {self.name}: {self._death.result()}")
        return None

    def _decode(self, data: bytes) -> Batch:
        if self.kind == "transform":
            msg = vocoder.output_decoder.decode(data)
            return Batch([Packet(o.request_id, None, o.frames, o.finished, o.finish_reason, o.error)
                          for o in msg.outputs])
        msg = engine_decoder.decode(data)
        if isinstance(msg, StatsReport):
            return Batch([], msg)
        assert isinstance(msg, OutputBatch)
        return Batch([Packet(o.request_id, o.new_token_ids, None, o.finished, o.finish_reason, o.error)
                      for o in msg.outputs])

    async def shutdown(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if self._recv is not None:
            self._recv.cancel()
        if not proc.dead:
            asyncio.get_running_loop().remove_reader(proc.proc.sentinel)
        if self._death is not None and not self._death.done():
            self._death.set_result("shut down")
        self._sock.close(linger=0)
        await asyncio.to_thread(proc.stop, not proc.dead, False)
        self._ctx.term()

