"""hotloop.MessageQueue: one writer, many readers, across processes, over a shared-memory ring.

Names follow vLLM's MessageQueue, so engine code can switch::

    mq = MessageQueue(n_reader=2)                 # writer
    handle = mq.export_handle()                   # small, picklable: send it to the workers
    # in worker i:  reader = MessageQueue.create_from_handle(handle, rank=i)
    mq.wait_until_ready(timeout=30)               # every reader attached (the segment name is then removed)
    mq.enqueue({"step": 1, "tensor": t})          # one copy into shared memory, pickle 5 out-of-band buffers
    obj = reader.dequeue(timeout=1.0)             # the reader's own copy; never aliases ring memory

A reader is a source for :func:`hotloop.wait_any` (pass the queue itself). ``dequeue`` waits in C++ with the GIL
released (spin, yield, park); ``readable()`` is one atomic load; ``acquire_read()`` lends a zero-copy view;
``await dequeue_async()`` serves asyncio. Failures: a full ring raises TimeoutError naming the slow reader; a
dead reader raises DeadPeerError in the writer (or is dropped, ``dead_reader="drop"``); a dead writer or
``shutdown()`` wakes parked readers with DeadPeerError / ClosedError once every earlier message is delivered.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import weakref
from dataclasses import dataclass

from hotloop import _core
from hotloop import serialization
from hotloop._core import BadHandleError, ClosedError, DeadPeerError, QueueTimeout, WaitPolicy

HANDLE_VERSION = 1
DEFAULT_RING_BYTES = 1 << 24


@dataclass(frozen=True)
class Handle:
    """What a reader needs to attach: picklable, a few hundred bytes."""

    version: int
    name: str
    capacity: int
    n_local_reader: int
    writer_pid: int


def _ring_bytes(max_chunk_bytes: int) -> int:
    """The ring size: a power of two holding at least four max_chunk_bytes messages (each fits one record)."""
    need = max(4096, 4 * (int(max_chunk_bytes) + 64))
    return 1 << (need - 1).bit_length()


class MessageQueue:
    def __init__(self, n_reader: int, n_local_reader: int | None = None, max_chunk_bytes: int = DEFAULT_RING_BYTES // 4,
                 max_message_bytes: int | None = None, dead_reader: str = "raise", policy: WaitPolicy | None = None,
                 name: str = ""):
        """The writer. Messages up to max_chunk_bytes are read zero-copy from one record; larger ones are split.

        n_reader: readers in all; n_local_reader: those on this node (default: all; remote readers need the
        network transport, not available in this version). max_message_bytes: a larger enqueue raises
        ValueError and leaves the queue usable (default: no limit). dead_reader: "raise" or "drop".
        """
        if n_local_reader is None:
            n_local_reader = n_reader
        if n_local_reader != n_reader:
            raise NotImplementedError("remote readers (n_local_reader < n_reader) are not supported yet: "
                                      "every reader must run on the writer's node")
        if n_reader < 1:
            raise ValueError(f"a MessageQueue needs at least one reader, got n_reader={n_reader}")
        _core.reap_stale_segments()
        self._ring = _core.ShmRing.create(_ring_bytes(max_chunk_bytes), n_local_reader, max_message_bytes or 0,
                                          dead_reader, name)
        self._policy = policy if policy is not None else WaitPolicy()
        self._handle = Handle(HANDLE_VERSION, self._ring.name, self._ring.capacity, n_local_reader, os.getpid())
        self.rank = -1
        self._async_watcher = None

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, policy: WaitPolicy | None = None) -> "MessageQueue":
        """Reader `rank` (0 <= rank < n_local_reader) of the queue `handle` describes."""
        if not isinstance(handle, Handle):
            raise BadHandleError(f"not a MessageQueue handle: {type(handle).__name__} (use export_handle())")
        if handle.version != HANDLE_VERSION:
            raise BadHandleError(f"handle of version {handle.version}, this hotloop reads version {HANDLE_VERSION}: "
                                 "use the same hotloop version in every process")
        self = cls.__new__(cls)
        self._ring = _core.ShmRing.attach(handle.name, rank, handle.capacity, handle.n_local_reader)
        self._policy = policy if policy is not None else WaitPolicy()
        self._handle = handle
        self.rank = rank
        self._async_watcher = None
        return self

    # ---- both sides ----

    def export_handle(self) -> Handle:
        return self._handle

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def is_writer(self) -> bool:
        return self.rank < 0

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: wait until every reader attached (raises TimeoutError naming how many did). Reader: no-op."""
        if self.is_writer and not self._ring.wait_all_attached(timeout, self._policy):
            raise TimeoutError(f"queue {self.name}: {self._ring.attached_readers} of {self._ring.n_readers} readers "
                               f"attached within {timeout} s; start the missing readers with this queue's handle")

    def shutdown(self) -> None:
        """Writer: no more messages. Parked readers wake and raise ClosedError once they have read the rest."""
        if not self._ring.closed:
            self._ring.shutdown()

    def close(self) -> None:
        """Release the queue (a writer shuts it down first). Idempotent."""
        if self._async_watcher is not None:
            self._async_watcher.stop()
            self._async_watcher = None
        self._ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # ---- writer ----

    def enqueue(self, obj, timeout: float | None = None) -> None:
        """Send `obj` to every reader. Raises TimeoutError (a full ring; names the slowest reader), DeadPeerError,
        ClosedError (after shutdown), ValueError (larger than max_message_bytes); pickling errors leave the
        queue untouched."""
        parts, keep_alive = serialization.dumps(obj)
        self._ring.write(parts, timeout, self._policy)
        del keep_alive

    def enqueue_bytes(self, data, timeout: float | None = None) -> None:
        """Send a bytes-like object as is (no pickling); read it with dequeue_bytes."""
        self._ring.write([data], timeout, self._policy)

    # ---- reader ----

    def readable(self) -> bool:
        """Whether a message is waiting: one atomic load, no system call."""
        return self._ring.readable()

    @property
    def hotloop_source(self):
        """The wait_any source of a reader (wait_any accepts the queue itself)."""
        return self._ring.source

    def dequeue(self, timeout: float | None = None):
        """The next object. Raises TimeoutError, ClosedError (shut down and drained), DeadPeerError (writer died)."""
        return serialization.loads(self.dequeue_bytes(timeout))

    def dequeue_bytes(self, timeout: float | None = None) -> memoryview:
        """The next message's bytes: a writable buffer owned by the caller."""
        buf = self._ring.read(timeout, self._policy)
        if buf is None:
            raise TimeoutError(f"queue {self.name}: no message within {timeout} s")
        return buf

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None):
        """Lend the next message as a read-only memoryview of ring memory (zero-copy when it fits one record).

        The view is released when the block ends; keeping a reference to it (or to an array over it) past
        the block raises BufferError there, so ring memory is never read after the writer may reuse it.
        """
        view = self._ring.read_view(timeout, self._policy)
        if view is None:
            raise TimeoutError(f"queue {self.name}: no message within {timeout} s")
        try:
            yield view
        finally:
            view.release()
            self._ring.release()

    async def dequeue_async(self, timeout: float | None = None):
        """asyncio: the next object; the event loop is woken by the writer (no polling timer)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with contextlib.suppress(TimeoutError):
                return self.dequeue(timeout=0)
            if self._async_watcher is None:
                self._async_watcher = _ReadableWatcher(self._ring)
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"queue {self.name}: no message within {timeout} s")
            fut = loop.create_future()
            self._async_watcher.notify(loop, fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(f"queue {self.name}: no message within {timeout} s") from None


class _ReadableWatcher:
    """One thread per asyncio reader: waits (GIL released, parked when idle) until the ring is readable, shut
    down or its writer dead, then wakes the awaiting coroutines. Not a thread per message, and no polling timer:
    the writer's publish wakes it (it re-checks for stop() every 250 ms)."""

    def __init__(self, ring):
        self._ring = ring
        self._requests = _core.InputQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"hotloop-mq-async-{ring.name}", daemon=True)
        self._thread.start()
        _WATCHERS.add(self)

    def notify(self, loop, fut) -> None:
        self._requests.put((loop, fut))

    def stop(self) -> None:
        self._stopping = True
        self._requests.close()
        self._thread.join()
        _WATCHERS.discard(self)

    def _run(self):
        park = WaitPolicy(spin_us=0, yield_us=0)
        while True:
            try:
                pending = [self._requests.get()]
            except ClosedError:
                return
            while not self._stopping:
                try:
                    if self._ring.wait_readable(0.25, park):
                        break
                except (ClosedError, DeadPeerError):
                    break  # the coroutine's own dequeue raises it
            pending += self._requests.drain()
            for loop, fut in pending:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                    loop.call_soon_threadsafe(_resolve, fut)


_WATCHERS: "weakref.WeakSet[_ReadableWatcher]" = weakref.WeakSet()


@atexit.register
def _stop_watchers():
    for w in list(_WATCHERS):
        w.stop()


def _resolve(fut):
    if not fut.done():
        fut.set_result(None)


__all__ = ["BadHandleError", "ClosedError", "DeadPeerError", "Handle", "MessageQueue", "QueueTimeout"]
