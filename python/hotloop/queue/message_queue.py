"""hotloop.MessageQueue: one writer, many readers, across processes, over a shared-memory ring.

Names follow vLLM's MessageQueue, so engine code can switch::

    mq = MessageQueue(n_reader=2)                 # writer
    handle = mq.export_handle()                   # small, picklable: send it to the workers
    # in worker i:  reader = MessageQueue.create_from_handle(handle, rank=i)
    mq.wait_until_ready(timeout=30)               # every reader attached (the segment name is then removed)
    mq.enqueue({"step": 1, "tensor": t})          # one copy into shared memory, pickle 5 out-of-band buffers
    obj = reader.dequeue(timeout=1.0)             # the reader's own copy; never aliases ring memory

Ranks at or above ``n_local_reader`` are readers on other nodes: same API, over TCP (``remote/``). The
queue is a facade over declared backends (``backends.py``): a reader has one ``ReaderBackend`` (the
shared-memory ring or the network subscriber), the writer a ``WriterBackend`` per kind of reader it has.
A reader is a source for :func:`hotloop.wait_any` (pass the queue itself). ``dequeue`` waits in C++ with the GIL
released (spin, yield, park); ``readable()`` is one atomic load; ``acquire_read()`` lends a zero-copy view;
``await dequeue_async()`` serves asyncio. Failures: every wait that runs out raises QueueTimeout (a TimeoutError:
a reader's wait for a message, worded once in ``no_message``; a writer's for ring space, naming the slow reader,
or for a remote reader's send buffer; ``wait_until_ready``); a dead reader raises DeadPeerError in the writer (or
is dropped, ``dead_reader="drop"``); a dead writer or ``shutdown()`` wakes parked readers with DeadPeerError /
ClosedError once every earlier message is delivered. A reader's call on the writer, or ``enqueue`` on a reader,
raises RuntimeError saying which side may make it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import os
import re
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

from hotloop import _core
from hotloop.queue import relay, serialization
from hotloop._core import BadHandleError, ClosedError, DeadPeerError, QueueTimeout, WaitPolicy
from hotloop.queue.backends import ReaderBackend, WriterBackend
from hotloop.queue.remote import RemotePublisher, RemoteSubscriber

_OBJECT_LOADERS, _NOTHING = serialization.OBJECT_LOADERS, serialization.NOTHING
_THREAD_PICKLERS = serialization.THREAD_PICKLERS

HANDLE_VERSION = 5  # 5: remote readers that share a node read through its relay (the handle carries dead_reader)
DEFAULT_RING_BYTES = 1 << 24


@dataclass(frozen=True)
class Handle:
    """What a reader needs to attach: picklable, a few hundred bytes.

    With remote readers it holds their CurveZMQ secret keys: whoever has the handle can read the queue, so pass
    it only over a trusted channel (a spawn pipe, an authenticated RPC), as a password. Its repr hides the keys.
    """

    version: int
    name: str  # the shared-memory segment ("" when every reader is remote)
    capacity: int
    n_local_reader: int  # ranks 0 .. n_local_reader-1 read shared memory, the rest the network
    writer_pid: int
    n_reader: int
    remote_address: str | None  # tcp://ip:port of the writer's publisher, when there are remote readers
    remote_hwm: int  # messages queued per remote reader in the writer's process before enqueue waits
    remote_server_key: bytes | None = field(default=None, repr=False)  # the writer's CurveZMQ public key (z85)
    # (public, secret) CurveZMQ client key pair of each remote rank, in rank order from n_local_reader
    remote_client_keys: tuple[tuple[bytes, bytes], ...] = field(default=(), repr=False)
    dead_reader: str = "raise"  # what a writer (or a node's relay) does about a dead reader: "raise" or "drop"


def no_message(queue_name: str, timeout) -> QueueTimeout:
    """The error of a reader's wait for a message that ran out (dequeue, dequeue_bytes, acquire_read,
    dequeue_async; the bound C++ dequeue calls it too): the one wording of it."""
    return QueueTimeout(f"queue {queue_name}: no message within {timeout} s; the writer sent nothing in that "
                        "time (wait longer, or timeout=None to wait until one comes)")


def _write_assembled(ring: _core.ShmRing, timeout: float | None, policy: WaitPolicy) -> None:
    """ObjectWriter's way for a message that is not one bare pickle: the parts the thread's pickler left."""
    parts, keep_alive = serialization.assemble(serialization.encoder())
    ring.write(parts, timeout, policy)
    del keep_alive


def _ring_bytes(max_chunk_bytes: int) -> int:
    """The ring size: a power of two holding at least four max_chunk_bytes messages (each fits one record)."""
    need = max(4096, 4 * (int(max_chunk_bytes) + 64))
    return 1 << (need - 1).bit_length()


_TCP_ADDRESS = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[\w.-]+):([1-9][0-9]{0,4})")


def _check_handle(handle, rank) -> None:
    """Raise BadHandleError unless `handle` is a well-formed handle of this version and `rank` one of its ranks."""
    if not isinstance(handle, Handle):
        raise BadHandleError(f"not a MessageQueue handle: {type(handle).__name__} (use export_handle())")
    if handle.version != HANDLE_VERSION:
        raise BadHandleError(f"handle of version {handle.version!r}, this hotloop reads version {HANDLE_VERSION}: "
                             "use the same hotloop version in every process")

    def is_int(v, low=0):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    keys = handle.remote_client_keys
    counts_ok = is_int(handle.n_reader) and is_int(handle.n_local_reader)
    n_remote = handle.n_reader - handle.n_local_reader if counts_ok else -1
    problems = [what for what, ok in (
        ("name", isinstance(handle.name, str) and len(handle.name) < 256),
        ("capacity", is_int(handle.capacity)),
        ("n_reader", is_int(handle.n_reader, 1)),
        ("n_local_reader", is_int(handle.n_local_reader) and 0 <= n_remote),
        ("writer_pid", is_int(handle.writer_pid)),
        ("remote_address", handle.remote_address is None if n_remote == 0 else
         isinstance(handle.remote_address, str) and _TCP_ADDRESS.fullmatch(handle.remote_address) is not None),
        ("remote_hwm", is_int(handle.remote_hwm, 1) and handle.remote_hwm < 1 << 31),
        ("remote_server_key", handle.remote_server_key is None if n_remote == 0 else
         isinstance(handle.remote_server_key, bytes) and len(handle.remote_server_key) == 40),
        ("dead_reader", handle.dead_reader in ("raise", "drop")),
        ("remote_client_keys", isinstance(keys, tuple) and len(keys) == max(n_remote, 0) and all(
            isinstance(k, tuple) and len(k) == 2 and all(isinstance(b, bytes) and len(b) == 40 for b in k)
            for k in keys)),
    ) if not ok]
    if problems:
        raise BadHandleError(f"corrupt MessageQueue handle: bad {', '.join(problems)}; pass the object "
                             "export_handle() returned, unchanged")
    if not is_int(rank) or rank >= handle.n_reader:
        raise BadHandleError(f"queue {handle.name}: reader rank {rank!r} is out of range; this queue has ranks "
                             f"0..{handle.n_reader - 1}")


class MessageQueue:
    def __init__(self, n_reader: int, n_local_reader: int | None = None, max_chunk_bytes: int = DEFAULT_RING_BYTES // 4,
                 max_message_bytes: int | None = None, dead_reader: str = "raise", policy: WaitPolicy | None = None,
                 name: str = "", connect_ip: str | None = None, bind_ip: str | None = None, remote_hwm: int = 1000):
        """The writer. Messages up to max_chunk_bytes are read zero-copy from one record; larger ones are split.

        n_reader: readers in all; n_local_reader: those on this node (default: all). Ranks below n_local_reader
        read shared memory; the others read over TCP (CurveZMQ: authenticated, encrypted) from a publisher reached
        at connect_ip (default: $HOTLOOP_HOST_IP, else this node's outbound address) and bound on bind_ip
        (default: connect_ip itself; the wildcard address binds every interface, only if you pass it).
        max_message_bytes: a larger enqueue raises ValueError and leaves the queue usable (default: no limit).
        dead_reader: "raise" or "drop".
        remote_hwm: messages queued for each remote reader in the writer's process (beyond what the network and
        the reader's process hold) before enqueue waits for it.
        """
        if n_local_reader is None:
            n_local_reader = n_reader
        if n_reader < 1:
            raise ValueError(f"a MessageQueue needs at least one reader, got n_reader={n_reader}")
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"n_local_reader={n_local_reader} must be between 0 and n_reader={n_reader}")
        if dead_reader not in ("raise", "drop"):
            raise ValueError(f"dead_reader must be 'raise' or 'drop', got {dead_reader!r}")
        max_message_bytes = max_message_bytes or 0
        local = remote = None
        if n_local_reader:
            _core.reap_stale_segments()
            local = _core.ShmRing.create(_ring_bytes(max_chunk_bytes), n_local_reader, max_message_bytes,
                                         dead_reader, name)
            qname, capacity = local.name, local.capacity
        else:
            qname, capacity = name or f"hotloop-net-{os.getpid()}-{id(self):x}", 0
        if n_local_reader < n_reader:
            try:
                remote = RemotePublisher(qname, range(n_local_reader, n_reader), connect_ip, bind_ip, dead_reader,
                                         remote_hwm)
            except BaseException:
                if local is not None:
                    local.close()
                raise
        handle = Handle(HANDLE_VERSION, qname, capacity, n_local_reader, os.getpid(), n_reader,
                        remote.address if remote else None, remote_hwm,
                        remote.server_public if remote else None, remote.client_keys if remote else (), dead_reader)
        self._setup(handle, -1, policy, writers=(remote, local), max_message_bytes=max_message_bytes)

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, policy: WaitPolicy | None = None,
                           node: str | None = None) -> "MessageQueue":
        """Reader `rank` (0 <= rank < n_reader) of the queue `handle` describes: a shared-memory reader when
        rank < handle.n_local_reader, a network reader otherwise (same API).

        node: a network reader's node (default ``hotloop.queue.relay.node_id()``: this host). Network readers of
        the queue that name the same node share one stream from the writer through the node's relay
        (``relay.py``); ``""`` connects this reader on its own. A queue with one network reader never relays."""
        _check_handle(handle, rank)
        companions = ()
        if node is None and handle.n_reader - handle.n_local_reader > 1:
            node = relay.node_id()
        if rank < handle.n_local_reader:
            reader = _core.ShmRing.attach(handle.name, rank, handle.capacity, handle.n_local_reader)
        elif node:
            reader, companions = relay.attach(handle, rank, node)
        else:
            reader = RemoteSubscriber(handle.remote_address, rank, handle.name, handle.remote_server_key,
                                      handle.remote_client_keys[rank - handle.n_local_reader])
            if policy is None:  # a network reader parks at once (see RemoteSubscriber.DEFAULT_POLICY)
                policy = RemoteSubscriber.DEFAULT_POLICY
        self = cls.__new__(cls)
        self._setup(handle, rank, policy, reader=reader, companions=companions)
        return self

    def _setup(self, handle: Handle, rank: int, policy: WaitPolicy | None, reader: ReaderBackend | None = None,
               writers: tuple = (), max_message_bytes: int = 0, companions: tuple = ()) -> None:
        """The one place a queue's fields are set, for the writer (rank -1: its remote and local backends, either
        may be None) and for a reader (its backend, and what closes with it: a relayed reader's presence
        connection and, on its node's first reader, the relay)."""
        self._handle = handle
        self.rank = rank
        self._policy = policy if policy is not None else WaitPolicy()
        self._reader = reader
        self._remote, self._local = writers if writers else (None, None)
        self._writers = tuple(w for w in writers if w is not None)  # in write order: the network first
        self._max_message_bytes = max_message_bytes
        # The object paths in one call into the ring, where shared memory is the only side; unless a subclass
        # overrides them, enqueue and dequeue are then that call itself, bound to the ring and the policy (a
        # Python method around it cost ~60 ns a message, a fifth of a 64 B object's one-way trip).
        self._object_ring = self._local if self._writers == (self._local,) else None
        self._object_reader = reader if isinstance(reader, _core.ShmRing) else None
        cls = type(self)  # a subclass's override, or a patched class attribute (unittest.mock), is kept
        if self._object_ring is not None and cls.enqueue is _CLASS_ENQUEUE:
            self.enqueue = _core.ObjectWriter(self._object_ring, self._policy, _THREAD_PICKLERS, _write_assembled)
        if self._object_reader is not None and cls.dequeue is _CLASS_DEQUEUE:
            self.dequeue = _core.ObjectReader(self._object_reader, self._policy, _OBJECT_LOADERS,
                                              functools.partial(no_message, self.name))
        self._async_watcher = None
        self._companions = companions
        assert reader is None or isinstance(reader, ReaderBackend), type(reader)
        assert all(isinstance(w, WriterBackend) for w in self._writers), self._writers

    # ---- both sides ----

    def export_handle(self) -> Handle:
        return self._handle

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def is_writer(self) -> bool:
        return self.rank < 0

    @property
    def network_stats(self) -> dict:
        """Writer with remote readers: attached remote ranks, connections refused (not one of this queue's
        readers), subscription frames ignored (malformed or forged) and the nodes whose readers share a relay
        (node -> the rank running it); empty otherwise."""
        if not self.is_writer or self._remote is None:
            return {}
        self._remote.poll_peers()
        return {"attached": sorted(self._remote.attached), "rejected_peers": self._remote.rejected_peers,
                "ignored_frames": self._remote.ignored_frames, "relays": dict(self._remote.relay_rank)}

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: wait until every reader attached (raises QueueTimeout naming how many did). Reader: no-op."""
        if not self.is_writer:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for backend in (self._local, self._remote):  # shared memory first: local readers start fastest
            if backend is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not backend.wait_all_attached(left, self._policy):
                counts = " and ".join(f"{b.attached_readers} of {b.n_readers} {where}" for b, where in
                                      ((self._local, "local"), (self._remote, "remote")) if b is not None)
                raise QueueTimeout(f"queue {self.name}: {counts} readers attached within {timeout} s; "
                                   "start the missing readers with this queue's handle")

    def shutdown(self) -> None:
        """Writer: no more messages; parked readers wake and raise ClosedError once they have read the rest.
        Reader (from any thread): this reader's waits, running or later, end with ClosedError at once (a
        worker's watchdog ends a worker parked in dequeue this way); the writer and other readers go on."""
        if not self.is_writer:
            self._reader.cancel_waits()
            return
        for backend in self._writers:
            with contextlib.suppress(ClosedError):  # closed already: nothing more can be sent anyway
                backend.shutdown()

    def close(self) -> None:
        """Release the queue (a writer shuts it down first). Idempotent; from any thread: a wait in another
        thread ends with ClosedError."""
        if self._async_watcher is not None:
            self._async_watcher.stop()
            self._async_watcher = None
        if self._reader is not None:
            self._reader.close()
        for companion in self._companions:
            companion.close()
        for backend in self._writers:
            backend.close()  # the writer's own copy shuts down first; a copy inherited by a fork does not

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Everything is released here except a shared-memory ring whose bound enqueue/dequeue the caller kept
        # (`recv = MessageQueue.create_from_handle(h, 0).dequeue`): as a kept bound method kept the whole queue,
        # that ring stays open, and closes with its last reference (ShmRing's destructor does what close does).
        try:  # not contextlib.suppress: at interpreter exit the module's globals may already be gone
            if self._async_watcher is not None:
                self._async_watcher.stop()
            kept = self._rings_of_kept_calls()
            for backend in (self._reader, *self._writers):
                if backend is not None and id(backend) not in kept:
                    backend.close()
            for companion in self._companions:
                companion.close()
        except Exception:
            pass

    def _rings_of_kept_calls(self) -> set[int]:
        """ids of the rings whose bound enqueue/dequeue (ObjectWriter/ObjectReader) someone else still holds."""
        kept = set()
        for attr, ring in (("enqueue", self._object_ring), ("dequeue", self._object_reader)):
            call = self.__dict__.get(attr)
            # Its references: this instance's dict, `call` here and getrefcount's argument; any more are a caller's.
            if call is not None and sys.getrefcount(call) > 3:
                kept.add(id(ring))
        return kept

    # ---- writer ----

    def enqueue(self, obj, timeout: float | None = None) -> None:
        """Send `obj` to every reader. Raises QueueTimeout (a full ring; names the slowest reader), DeadPeerError,
        ClosedError (after shutdown), ValueError (larger than max_message_bytes); pickling errors leave the
        queue untouched."""
        ring = self._object_ring
        if ring is not None:  # what the bound ObjectWriter does, for a subclass that calls this method
            if not ring.write_object(obj, timeout, self._policy, _THREAD_PICKLERS):
                _write_assembled(ring, timeout, self._policy)  # not a bare pickle: the parts it left
            return
        parts, keep_alive = serialization.dumps(obj)
        self._write(parts, timeout)
        del keep_alive

    def enqueue_bytes(self, data, timeout: float | None = None) -> None:
        """Send a bytes-like object as is (no pickling); read it with dequeue_bytes."""
        self._write([data], timeout)

    def _write(self, parts: list, timeout: float | None) -> None:
        """Remote readers first, then shared memory. A QueueTimeout or DeadPeerError from the network side means
        no local reader got the message; one from the ring after a network send means remote readers did."""
        if self.rank >= 0:  # not is_writer (a property call less on the hot path)
            raise RuntimeError(f"queue {self.name}: reader rank {self.rank} cannot enqueue; only the writer can "
                               "(the MessageQueue(...) that created the queue): send from the writer's process")
        if self._remote is not None and self._max_message_bytes:  # the ring checks its own
            size = memoryview(parts[0]).nbytes if len(parts) == 1 else sum(memoryview(p).nbytes for p in parts)
            if size > self._max_message_bytes:
                raise ValueError(f"queue {self.name}: message of {size} bytes is larger than max_message_bytes="
                                 f"{self._max_message_bytes}; send less or raise the limit")
        for backend in self._writers:
            backend.write(parts, timeout, self._policy)

    # ---- reader ----

    def _not_a_reader(self, call: str) -> RuntimeError:
        """The error of a reader's call made on the writer."""
        return RuntimeError(f"queue {self.name}: {call} is a reader's call and this is the queue's writer, which "
                            "has no messages to read; read on a reader, MessageQueue.create_from_handle("
                            "writer.export_handle(), rank)")

    def readable(self) -> bool:
        """Whether a message is waiting: one atomic load, no system call."""
        try:
            return self._reader.readable()
        except AttributeError:
            if self._reader is None:
                raise self._not_a_reader("readable()") from None
            raise

    @property
    def hotloop_source(self):
        """The wait_any source of a reader (wait_any accepts the queue itself). The writer has none: an
        AttributeError, so ``hasattr(writer, "hotloop_source")`` is False."""
        if self._reader is None:
            raise AttributeError(f"queue {self.name}: the writer has no hotloop_source (it has no messages to wait "
                                 "for); wait on a reader, MessageQueue.create_from_handle(writer.export_handle(), "
                                 "rank)")
        return self._reader.source

    @property
    def wait_stats(self) -> dict | None:
        """This side's waits in the shared-memory ring (hotloop.metrics describes the dict): a local reader's, or
        the writer's (waits for space); None for a network reader or a writer without local readers."""
        return getattr(self._reader if self._reader is not None else self._local, "wait_stats", None)

    @property
    def parks(self) -> int:
        """How many times this side's ring waits parked in the kernel so far (``wait_stats["parks"]`` at the cost of
        one load; 0 for a network reader)."""
        ring = self._reader if self._reader is not None else self._local
        return ring.parks if ring is not None and hasattr(ring, "parks") else 0

    def dequeue(self, timeout: float | None = None):
        """The next object. Raises QueueTimeout, ClosedError (shut down and drained), DeadPeerError (writer died)."""
        ring = self._object_reader
        if ring is None:
            if self._reader is None:
                raise self._not_a_reader("dequeue()")
            return serialization.loads(self.dequeue_bytes(timeout))
        obj = ring.read_object(timeout, self._policy, _OBJECT_LOADERS)
        if obj is _NOTHING:
            raise no_message(self.name, timeout)
        return obj

    def dequeue_bytes(self, timeout: float | None = None) -> memoryview:
        """The next message's bytes: a writable buffer owned by the caller."""
        try:
            buf = self._reader.read(timeout, self._policy)
        except AttributeError:
            if self._reader is None:
                raise self._not_a_reader("dequeue_bytes()") from None
            raise
        if buf is None:
            raise no_message(self.name, timeout)
        return buf

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None):
        """Lend the next message as a read-only memoryview of ring memory (zero-copy when it fits one record).

        The view is released when the block ends; keeping a reference to it (or to an array over it) past
        the block raises BufferError there, so ring memory is never read after the writer may reuse it.
        """
        if self._reader is None:
            raise self._not_a_reader("acquire_read()")
        view = self._reader.read_view(timeout, self._policy)
        if view is None:
            raise no_message(self.name, timeout)
        try:
            yield view
        finally:
            view.release()
            self._reader.release()

    async def dequeue_async(self, timeout: float | None = None):
        """asyncio: the next object; the event loop is woken by the writer (no polling timer)."""
        if self._reader is None:
            raise self._not_a_reader("dequeue_async()")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with contextlib.suppress(TimeoutError):  # QueueTimeout, or a subclass override's TimeoutError
                return self.dequeue(timeout=0)
            if self._async_watcher is None:
                self._async_watcher = _ReadableWatcher(self._reader)
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise no_message(self.name, timeout)
            fut = loop.create_future()
            self._async_watcher.notify(loop, fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                raise no_message(self.name, timeout) from None


# The class's own enqueue/dequeue: a queue binds the C++ calls in their place only while the class still has these.
_CLASS_ENQUEUE, _CLASS_DEQUEUE = MessageQueue.enqueue, MessageQueue.dequeue


def _call_signature(method) -> inspect.Signature:
    """`method`'s signature without `self`: what the C++ call bound in its place takes."""
    sig = inspect.signature(method)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


# inspect.signature(q.enqueue) (and what relies on it: help(), IDEs, unittest.mock) answers with the methods' own
# parameters when the queue has bound the C++ calls in their place; nanobind functions carry no signature that
# inspect can read. On the classes, so this costs a queue nothing. (unittest.mock's autospec of a queue still
# records calls to them without checking their arguments: it reads a callable object's signature from its
# __call__, here a nanobind method; autospec the class, MessageQueue, for checked calls.)
_core.ObjectWriter.__signature__ = _call_signature(MessageQueue.enqueue)
_core.ObjectReader.__signature__ = _call_signature(MessageQueue.dequeue)


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
