"""The engine core's inputs read by its main thread where it waits, without a hand-off from vLLM's input thread.

Contract:

- What vLLM does (0.30-0.33, ``vllm/v1/engine/core.py``): the engine core's input thread
  (``process_input_sockets``) polls the front ends' DEALER sockets (and the data-parallel coordinator's XSUB),
  decodes each request (``MsgpackDecoder``; an ADD through ``preprocess_add_request``) and puts it into
  ``input_queue``, where the main thread takes it: between steps, or, with hotloop's engine-core loop, in the
  step's wait. Each request so wakes two threads, the input thread and then the main thread; on a host whose idle
  vCPUs halt each wake-up costs ~170 us here (docs/vllm.md), and the input thread then needs the GIL.
- What ``install()`` changes, with the engine-core loop (``engine_loop.py``): ``process_input_sockets`` is this
  module's. Where the main thread waits in hotloop's waits (see "Where it reads" below), it makes the same sockets
  and does the same handshake as vLLM's (vLLM's ``make_zmq_socket``, DEALER with the engine's identity, the ready
  payload, the coordinator's subscription and READY), then hands them to the engine core's ``EngineInputQueue``
  (an :class:`InputReader`) and sleeps until :meth:`InputReader.close`. The main thread then reads the sockets
  itself: its blocking ``get`` (the idle engine core) and the loop's step wait park on the sockets' descriptors
  beside the queue's doorbell, and every ``get_nowait`` / ``empty`` / ``qsize`` first reads what the sockets hold
  (``NOBLOCK``). Each message is decoded and handled as vLLM's input thread does it: a READY from the coordinator
  skipped, an ADD through ``preprocess_add_request`` (a multimodal cache miss, a validation error on 0.33, any
  other error answered by vLLM's own handlers, the request dropped), a fault-tolerance utility to the sentinel, an
  ABORT also into ``aborts_queue``; the rest goes into the queue in arrival order per socket. One wake-up per
  request, on the thread that handles it.
- Where it reads: only where nothing else keeps the main thread from the sockets while a request waits in them,
  else vLLM's input thread runs unchanged (``_reads_here``): the engine core's ``input_queue`` is the loop's
  ``EngineInputQueue``; the executor's response queues are hotloop's (the step's wait is then the loop's, which
  watches the sockets; with another executor a step blocks elsewhere and its inputs would wait undecoded); not a
  data-parallel engine core (the loop leaves those to vLLM); no tensor IPC receiver (its decode may wait for a
  tensor from another process) and no fault-tolerance sentinel (its commands must reach a main thread that may be
  stuck); and vLLM's ``process_input_sockets`` is one of the bodies this module mirrors (the digest of its syntax
  tree is in ``MIRRORED``; another one is refused with a warning naming the vLLM version). A utility call that
  blocks in vLLM's own ``result()`` delays the reads behind it, as it delays their handling in vLLM.
- Socket use: the sockets are made by the input thread and used by one thread at a time afterwards (the ready
  event, then the reader's lock: the full memory barrier libzmq asks for a socket that moves between threads).
  ZeroMQ's descriptor is edge-like (readable when the socket's state may have changed), so a wait on it follows a
  read that found ``ZMQ_EVENTS`` without a message on every socket: no message is left behind a descriptor that
  will not fire again. A read takes at most ``READ_BATCH`` messages, so a burst is read in batches and the loop's
  step wait looks at the step's answer between two.
- An error while decoding a message (a corrupt frame) raises in the main thread, which ends the engine core as
  vLLM reports a dead engine; vLLM's input thread would die with it and leave the engine core deaf.
- ``HOTLOOP_VLLM_INPUT_READ=0`` keeps vLLM's input thread with the loop on.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

import zmq

from hotloop._core import FdSource
from hotloop.vllm.class_patches import ClassPatches
from hotloop.vllm.mirrored import unmirrored

_ENGINE_CORE = "vllm.v1.engine.core"

# mirrored.tree_digest of vLLM's process_input_sockets, per body this module mirrors
MIRRORED = {
    "977b823a81ee89af": "0.30.0, 0.31.0, 0.32.0",
    "2fe892160571748c": "0.33.0 (adds the VLLMValidationError answer)",
}

log = logging.getLogger("vllm.hotloop")  # under vLLM's logger: its lines show in vLLM's log
# messages one read() decodes at most: a burst is read in batches, and the loop's step wait looks at the step's answer
# between two (vLLM's input thread decoded alongside the step; here a batch's decodes delay the answer's reading)
READ_BATCH = 16


class InputReader:
    """An engine core's input sockets, read by whichever thread waits for its inputs (see the module's contract).
    ``read(put)`` decodes every message the sockets hold and passes each one to handle to ``put``."""

    def __init__(self, engine, sockets: list, coord_socket, core_module):
        self.engine = engine
        self.sockets = list(sockets) + ([coord_socket] if coord_socket is not None else [])
        self.coord_socket = coord_socket
        self.sources = [FdSource(s.getsockopt(zmq.FD)) for s in self.sockets]
        self.core = core_module
        receiver = getattr(engine, "tensor_ipc_receiver", None)
        self.add_decoder = core_module.MsgpackDecoder(core_module.EngineCoreRequest, oob_tensor_provider=receiver)
        self.generic_decoder = core_module.MsgpackDecoder(oob_tensor_provider=receiver)
        self.validation_error = getattr(core_module, "VLLMValidationError", None)  # 0.33's answer
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.messages = 0  # read by this reader (loop_state reports it)

    def read(self, put) -> int:
        """Take up to ``READ_BATCH`` messages the sockets hold, one socket after the other in turn (never blocks), and
        ``put`` the ``(request_type, request)`` of each one to handle. Returns how many messages it took (put, or
        answered here); 0 means every socket showed nothing, so their descriptors may be waited on. A second thread
        that reads meanwhile waits for this one's batch (at most READ_BATCH decodes); a closed reader reads nothing."""
        taken = 0
        with self.lock:
            live = list(self.sockets)
            while live and taken < READ_BATCH:
                for socket in list(live):
                    if taken >= READ_BATCH:
                        break
                    if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # also clears the descriptor's edge
                        live.remove(socket)
                        continue
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    taken += 1
                    self.messages += 1
                    item = self.decode(socket, frames)
                    if item is not None:
                        put(item)
        return taken

    def decode(self, socket, frames):
        """One message as vLLM's input thread handles it: ``(request_type, request)`` to queue, or None where it is
        answered or dropped here."""
        core, engine = self.core, self.engine
        type_frame, *data_frames = frames
        if type_frame.buffer == b"READY":  # the coordinator's notice of a newly started engine
            assert socket is self.coord_socket
            return None
        request_type = core.EngineCoreRequestType(bytes(type_frame.buffer))
        if request_type == core.EngineCoreRequestType.ADD:
            req = self.add_decoder.decode(data_frames)
            try:
                return request_type, engine.preprocess_add_request(req)
            except core.MultiModalCacheMissError as e:
                engine._handle_mm_cache_miss(req, e)
            except Exception as e:
                if self.validation_error is not None and isinstance(e, self.validation_error):
                    engine._handle_request_validation_error(req, e)
                else:
                    engine._handle_request_preproc_error(req)
            return None
        request = self.generic_decoder.decode(data_frames)
        if request_type == core.EngineCoreRequestType.UTILITY:
            client_idx, call_id, method, args = request
            if method == core.FT_UTILITY_METHOD:
                engine.ft_sentinel.handle_command(client_idx, call_id, args[0])
                return None
        elif request_type == core.EngineCoreRequestType.ABORT:
            engine.aborts_queue.put_nowait(request)  # as vLLM: the step can finish it early, the queue keeps order
        return request_type, request

    def close(self) -> None:
        """Let the input thread close the sockets (tests; vLLM's input thread never leaves its loop)."""
        self.closed.set()


_vllm_process_input_sockets = None  # vLLM's, kept by install()


def _reads_here(engine) -> str | None:
    """Why the main thread cannot read this engine core's sockets, by its settings (vLLM's input thread then runs),
    or None; whether vLLM's body is one this module mirrors is checked after."""
    from hotloop.vllm import engine_loop

    if not isinstance(engine.input_queue, engine_loop.EngineInputQueue):
        return "the engine-core loop is off"
    if engine_loop._dp_engine_core(engine):
        return "a data-parallel engine core keeps vLLM's loop"
    mqs = getattr(getattr(engine, "model_executor", None), "response_mqs", None)
    if not mqs or not all(hasattr(mq, "hotloop_source") for mq in mqs):
        return "the executor's step answers are not on hotloop's queue (its steps block outside the loop's wait)"
    if getattr(engine, "tensor_ipc_receiver", None) is not None:
        return "tensor IPC is on (a decode may wait for a tensor)"
    if getattr(engine, "ft_sentinel", None) is not None:
        return "fault tolerance is on (its commands must reach a stuck main thread)"
    return None


def process_input_sockets(self, input_addresses: list[str], coord_input_address: str | None, identity: bytes,
                          ready_event: threading.Event):
    """vLLM's input thread where the main thread cannot read the sockets; else the same sockets and handshake,
    handed to the ``EngineInputQueue``, then a sleep until the reader is closed."""
    why, level = _reads_here(self), logging.INFO
    if why is None:  # a body this module does not mirror is worth a warning; the other reasons are settings
        why, level = unmirrored(_vllm_process_input_sockets, MIRRORED, "this module"), logging.WARNING
    if why is not None:
        log.log(level, "hotloop: the engine core's inputs go through vLLM's input thread: %s", why)
        return _vllm_process_input_sockets(self, input_addresses, coord_input_address, identity, ready_event)
    import msgspec  # vLLM's dependency: its ready payload's encoding

    core = sys.modules[_ENGINE_CORE]
    with contextlib.ExitStack() as stack, zmq.Context() as ctx:
        sockets = [stack.enter_context(core.make_zmq_socket(ctx, address, zmq.DEALER, identity=identity, bind=False))
                   for address in input_addresses]
        coord_socket = None
        if coord_input_address is not None:
            coord_socket = stack.enter_context(core.make_zmq_socket(ctx, coord_input_address, zmq.XSUB,
                                                                    identity=identity, bind=False))
            coord_socket.send(b"\x01")  # subscribe
        ready_payload = msgspec.msgpack.encode(self._make_ready_response())
        for socket in sockets:
            socket.send(ready_payload)  # the front end's ROUTER sends to us only after this
        if coord_socket is not None:
            assert coord_socket.recv() == b"READY"
        reader = InputReader(self, sockets, coord_socket, core)
        self.input_queue.attach(reader)
        log.info("hotloop: the engine core's main thread reads its input sockets itself (HOTLOOP_VLLM_INPUT_READ=0: "
                 "vLLM's input thread)")
        ready_event.set()
        del ready_event
        reader.closed.wait()
        with reader.lock:  # a read in progress finishes first; later ones read nothing
            reader.sockets, reader.sources = [], []
            self.input_queue.attach(None)


def read_enabled() -> bool:
    """Whether the environment leaves the input read on with the loop (HOTLOOP_VLLM_INPUT_READ; on unless 0)."""
    from hotloop.vllm import env_flag

    return env_flag("HOTLOOP_VLLM_INPUT_READ") is not False


_patches = ClassPatches()


def install() -> None:
    """The engine core's input sockets read by its main thread where it can (idempotent). Needs vLLM's engine-core
    module; the loop (``engine_loop.install()``) makes the queue that reads them."""
    global _vllm_process_input_sockets
    import importlib

    proc = importlib.import_module(_ENGINE_CORE).EngineCoreProc
    if proc.__dict__.get("process_input_sockets") is process_input_sockets:
        return
    _vllm_process_input_sockets = proc.__dict__["process_input_sockets"]
    _patches.set(proc, "process_input_sockets", process_input_sockets)


def uninstall() -> None:
    _patches.restore()


def is_installed() -> bool:
    core = sys.modules.get(_ENGINE_CORE)
    return core is not None and core.EngineCoreProc.__dict__.get("process_input_sockets") is process_input_sockets


__all__ = ["MIRRORED", "InputReader", "install", "is_installed", "process_input_sockets",
           "read_enabled", "uninstall"]
