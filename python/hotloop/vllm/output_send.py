"""The engine core's outputs sent by the thread that makes them, without a hand-off to vLLM's output thread.

Contract:

- What vLLM does (0.30-0.33, ``vllm/v1/engine/core.py``): the engine core's main thread puts each step's outputs
  into ``output_queue`` (a ``queue.Queue``); the output thread (``process_output_sockets``) takes them, encodes
  them (``MsgpackEncoder.encode_into``, into a buffer ZeroMQ is done with) and sends them on the front end's PUSH
  socket (the data-parallel coordinator's for client index -1). Each output so waits for a thread's wake-up and
  then for the GIL, which the main thread holds while it schedules and broadcasts the next step.
- What ``install()`` changes (the engine-core process, ``EngineCoreProc`` and its subclasses): ``output_queue`` is
  an :class:`OutputQueue` (converted on its first read: ``queue_slot.py``) and ``process_output_sockets`` is this
  module's, which makes the same sockets (vLLM's ``make_zmq_socket``, PUSH, linger 4 s) and encodes the same way.
  A put with nothing queued before it is encoded and sent at once by the thread that puts it, with ``NOBLOCK``;
  otherwise it is queued for the output thread, which sends it as vLLM's does. Queued are: a put behind one still
  queued or being sent, one the socket would block on (a fallback: vLLM's PUSH sockets connect with no send
  limit, so they take a message at once), one the encoder or socket refuses before its first frame goes out (the
  output thread then meets the error where vLLM's meets it), ``ENGINE_CORE_DEAD``, and every put before the
  sockets are made or after the output thread has ended. An error after a message's first frame went out (a dead
  socket) is raised to the putting thread, as vLLM's output thread would raise it: resending would garble the
  stream.
- Order: outputs leave in put order, whichever thread sends them: a put sends itself only when nothing is queued
  or in the output thread's hands (``unsent == 0``), checked under the lock that also serializes those sends. The
  sockets are used by one thread at a time (libzmq allows a socket to move between threads across a full memory
  barrier: the lock, and the queue's own mutex).
- On with hotloop's queue (the plugin installs it in the engine-core process); ``HOTLOOP_VLLM_SEND=0`` keeps
  vLLM's output thread as it is, and so does a vLLM whose ``process_output_sockets`` is not a body this copy was
  written against (``MIRRORED``, the digest of its syntax tree: ``mirrored.py``), with a warning naming the
  release. ``uninstall()`` puts vLLM's back for engine cores made afterwards. Measured (docs/vllm.md, "The engine
  core's output send"): the hop from a step's outputs to the front end is below vLLM's or within 0.08 ms of it,
  where the hand-off had made it 1.4-2.8x vLLM's at TP=2. The encoding moves to the putting thread (the engine
  core's main thread, between a step's outputs and the next schedule): with large outputs (20 logprobs a token at
  batch 256, pooling outputs) that is 0.9-2.8 ms of the main thread's per step, which vLLM's output thread spends
  under the same GIL (``python -m hotloop.bench.vllm.output_encode``; docs/vllm.md).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import sys
import threading

import zmq

from hotloop.vllm.class_patches import ClassPatches
from hotloop.vllm.mirrored import unmirrored
from hotloop.vllm.queue_slot import QueueSlot

_ENGINE_CORE = "vllm.v1.engine.core"
# mirrored.tree_digest of vLLM's process_output_sockets, per body this module's copy was written against
MIRRORED = {"de2ed915af8ec966": "0.30.0, 0.31.0, 0.32.0, 0.33.0"}


class OutputSender:
    """The output thread's sockets and encoder, as vLLM's ``process_output_sockets`` keeps them: one PUSH socket
    per client, the coordinator's (client index -1) or None, and the send buffers reused once ZeroMQ is done with
    them. Used by one thread at a time (see the module's contract)."""

    def __init__(self, sockets, coord_socket, engine_index: int, encoder):
        self.sockets = sockets
        self.coord_socket = coord_socket
        self.engine_index = engine_index
        self.encoder = encoder
        self.reuse: list[bytearray] = []
        self.in_flight: collections.deque = collections.deque()  # (tracker, buffer) ZeroMQ may still be sending
        self.max_reuse = len(sockets) + 1
        self.mid_message = False  # a message's first frame sent, not its last (only an error leaves it so)

    def send(self, output, flags: int = 0) -> None:
        """Encode and send one ``(client_index, EngineCoreOutputs)``. With ``zmq.NOBLOCK`` in `flags` it raises
        ``zmq.Again`` having sent nothing where the socket would block (a message's frames go all or none)."""
        client_index, outputs = output
        outputs.engine_index = self.engine_index
        if client_index == -1:  # the coordinator's: small, no buffer reuse (as vLLM)
            self.coord_socket.send_multipart(self.encoder.encode(outputs), flags)
            return
        while self.in_flight and self.in_flight[-1][0].done:
            done = self.in_flight.pop()[1]
            if len(self.reuse) < self.max_reuse:
                self.reuse.append(done)
        buffer = self.reuse.pop() if self.reuse else bytearray()
        encoded = self.encoder.encode_into(outputs, buffer)
        # every frame made before the first goes out (a frame ZeroMQ refuses then fails with nothing sent); the
        # first tracked (its buffer is reused once ZeroMQ is done with it), the rest sent with it as one message
        socket = self.sockets[client_index]
        small = socket.copy_threshold  # as pyzmq's send(copy=False): a frame smaller than this is copied
        frames = [zmq.Frame(encoded[0], track=True, copy_threshold=small)]
        frames += [zmq.Frame(f, copy_threshold=small) for f in encoded[1:]]
        for i, frame in enumerate(frames):
            more = zmq.SNDMORE if i + 1 < len(frames) else 0
            socket.send(frame, (flags if i == 0 else 0) | more, copy=False)
            self.mid_message = bool(more)  # past the first frame: the rest go out whatever the flags
        tracker = frames[0].tracker
        if not tracker.done:
            self.in_flight.appendleft((tracker, buffer))
        elif len(self.reuse) < self.max_reuse:
            self.reuse.append(buffer)


class OutputQueue(queue.Queue):
    """The engine core's ``output_queue``: a put sends its output at once where nothing is ahead of it (see the
    module's contract), else queues it for the output thread. ``direct`` and ``queued`` count the two ways."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.sender: OutputSender | None = None  # set while the output thread's sockets are open
        self.unsent = 0  # outputs queued or in the output thread's hands
        self.direct = 0
        self.queued = 0

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        with self.lock:
            if self.unsent == 0 and self.sender is not None and not isinstance(item, bytes):
                try:
                    self.sender.send(item, zmq.NOBLOCK)
                except Exception:  # would block, or refused: the output thread sends it (or fails) as vLLM's
                    if self.sender.mid_message:  # part of it is out: sending it again would garble the stream
                        raise
                else:
                    self.direct += 1
                    return
            self.unsent += 1
            self.queued += 1
            super().put(item, block, timeout)  # unbounded: never blocks

    def attach(self, sender: OutputSender | None) -> None:
        with self.lock:
            self.sender = sender

    def sent(self) -> None:
        """The output thread has sent one output it took."""
        with self.lock:
            self.unsent -= 1


def process_output_sockets(self, output_paths: list[str], coord_output_path: str | None, engine_index: int):
    """vLLM's output thread (``EngineCoreProc.process_output_sockets``), its sockets shared with the putting thread
    through the ``OutputQueue``."""
    core = sys.modules[_ENGINE_CORE]
    out = self.output_queue
    with contextlib.ExitStack() as stack, zmq.Context() as ctx:  # linger: ENGINE_CORE_DEAD goes out before close
        sockets = [stack.enter_context(core.make_zmq_socket(ctx, path, zmq.PUSH, linger=4000))
                   for path in output_paths]
        coord_socket = (stack.enter_context(core.make_zmq_socket(ctx, coord_output_path, zmq.PUSH, bind=False,
                                                                 linger=4000))
                        if coord_output_path is not None else None)
        sender = OutputSender(sockets, coord_socket, engine_index, core.MsgpackEncoder())
        direct = isinstance(out, OutputQueue)
        if direct:
            out.attach(sender)
            _log.info("hotloop: the engine core sends each output from the thread that makes it where nothing is "
                      "queued ahead (HOTLOOP_VLLM_SEND=0: through vLLM's output thread)")
        try:
            while True:
                output = out.get()
                if output == core.EngineCoreProc.ENGINE_CORE_DEAD:
                    for socket in sockets:
                        socket.send(output)
                    break
                assert not isinstance(output, bytes)
                sender.send(output)
                if direct:
                    out.sent()
        finally:
            if direct:
                out.attach(None)  # before the sockets close: later puts are queued


def send_enabled() -> bool:
    """Whether the environment leaves the output send on (HOTLOOP_VLLM_SEND; on unless 0/false/no/off)."""
    from hotloop.vllm import env_flag

    return env_flag("HOTLOOP_VLLM_SEND") is not False


_patches = ClassPatches()
_log = logging.getLogger("vllm.hotloop")  # under vLLM's logger: its lines show in vLLM's log


def install() -> bool:
    """Outputs sent by their putting thread in this process (idempotent). Needs vLLM's engine-core module. False,
    with vLLM's output thread left as it is, where vLLM's ``process_output_sockets`` is not a body this module's
    copy was written against (``MIRRORED``)."""
    import importlib

    proc = importlib.import_module(_ENGINE_CORE).EngineCoreProc
    if proc.__dict__.get("process_output_sockets") is process_output_sockets:
        return True
    why = unmirrored(proc.__dict__["process_output_sockets"], MIRRORED, "output_send")
    if why is not None:
        _log.warning("hotloop: the engine core's outputs go through vLLM's output thread: %s", why)
        return False
    _patches.set(proc, "output_queue", QueueSlot("output_queue", OutputQueue))
    _patches.set(proc, "process_output_sockets", process_output_sockets)
    return True


def uninstall() -> None:
    _patches.restore()


def is_installed() -> bool:
    core = sys.modules.get(_ENGINE_CORE)
    return core is not None and core.EngineCoreProc.__dict__.get("process_output_sockets") is process_output_sockets


def counts(core) -> dict:
    """How the engine core's outputs went out so far: ``{"direct": n, "queued": n}`` (zeros on vLLM's queue)."""
    q = core.__dict__.get("output_queue")
    return {"direct": q.direct, "queued": q.queued} if isinstance(q, OutputQueue) else {"direct": 0, "queued": 0}


__all__ = ["MIRRORED", "OutputQueue", "OutputSender", "counts", "install", "is_installed", "process_output_sockets",
           "send_enabled", "uninstall"]
