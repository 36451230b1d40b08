"""``RemoteSubscriber``: a remote queue's reader end, one SUB socket behind one waitable descriptor (see the package's
contract, ``__init__.py``).

It has the reader surface of a shared-memory ring. Its lock makes ``read``, ``readable`` and ``close`` safe from
several threads; ``cancel_waits`` and ``close`` end a wait in another thread. Only a wait blocks (in ``wait_any``);
every other operation takes what ZeroMQ holds without blocking.
"""

from __future__ import annotations

import os
import select
import threading
import time

import zmq
import zmq.utils.monitor

from hotloop._core import ClosedError, DeadPeerError, FdSource, SourceError, WaitPolicy, wait_any
from hotloop.queue.remote.context import OPEN_ENDS, ProcessZmq
from hotloop.queue.remote.sockets import monitor_socket, reader_socket
from hotloop.queue.remote.wire import KIND_MESSAGE, KIND_SHUTDOWN, rank_topic

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class RemoteSubscriber:
    # A network reader's default wait: park at once, no spin. Its messages come through ZeroMQ's I/O thread in
    # this process, which needs a CPU to receive and decrypt them; a spinning reader competes with it (64 B round
    # trip between two processes over TCP loopback on a shared 2-core machine, same run: 69 us parked, 99 us
    # spinning 20 us first; hotloop.bench.remote_round_trip, 4 repetitions, twice: p50 69 us parked,
    # 135-144 us spinning 30 us first), and spinning on a descriptor is a poll() system call per check anyway. A
    # policy passed to MessageQueue.create_from_handle replaces it.
    DEFAULT_POLICY = WaitPolicy(spin_us=0, yield_us=0)

    def __init__(self, address: str, rank: int, queue_name: str, server_public: bytes,
                 client_keys: tuple[bytes, bytes], hwm: int = 1000, topic: bytes | None = None,
                 as_parts: bool = False):
        """Reader `rank`'s data connection; `topic` is what it tells the writer it is (default: the rank's own
        topic; a node's relay passes the node's). `as_parts`: read() returns each message as the list of its
        frames' buffers, uncopied (a node's relay writes them into its ring as they are)."""
        self._as_parts = as_parts
        self.name = queue_name
        self.address = address
        self._owner_pid = os.getpid()
        self._zmq = ProcessZmq.acquire()
        self._sock = self._monitor = self._epoll = self._signal = self._cancel_fd = None
        try:
            self._connect(address, topic or rank_topic(rank), server_public, client_keys, hwm)
        except BaseException:  # a reader that cannot start leaves no sockets, descriptors or threads behind
            self._release()
            raise
        OPEN_ENDS.add(self)
        self._cancelled = False  # set by cancel_waits()/close() from any thread (which also write _cancel_fd)
        self._lock = threading.Lock()  # ZeroMQ sockets are single-threaded: close() waits for a drain in progress
        self._pending: bytearray | None = None  # a received message not yet handed out
        self._lent: memoryview | None = None
        self._shut_down = False
        self._lost = False  # the connection to the writer dropped
        self.closed = False

    def _connect(self, address, topic, server_public, client_keys, hwm) -> None:
        self._sock = reader_socket(self._zmq.ctx, server_public, client_keys)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._monitor = monitor_socket(self._sock, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.connect(address)
        self._epoll = select.epoll()
        self._epoll.register(self._sock.getsockopt(zmq.FD), select.EPOLLIN)
        self._epoll.register(self._monitor.getsockopt(zmq.FD), select.EPOLLIN)
        self._signal = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # readable while there is something to take
        self._signalled = False
        self._epoll.register(self._signal, select.EPOLLIN)
        # Written by cancel_waits()/close(): ends a wait in another thread. A descriptor in the same epoll set (not
        # a doorbell beside it) keeps the wait on descriptors only, the cheaper park for a socket's wake-up.
        self._cancel_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._cancel_fd, select.EPOLLIN)
        self._fd_source = FdSource(self._epoll.fileno())

    # ---- the reader surface shared with ShmRing ----

    def readable(self) -> bool:
        """Whether a message is waiting, or the stream ended (the writer shut down or was lost: the next read
        raises), as the source says; never blocks. (A caller that waits on the source and then asks readable()
        must not find the source ready and nothing to take: it would spin.)"""
        with self._lock:
            self._drain()
            return self._pending is not None or self._shut_down or self._lost

    @property
    def source(self) -> FdSource:
        """The wait_any source: the epoll descriptor, the same object every time (see contract)."""
        with self._lock:
            self._drain()
        return self._fd_source

    def wait_readable(self, timeout: float | None = None, policy: WaitPolicy | None = None) -> bool:
        """Wait until a message is waiting: True, or False at the timeout. Raises ClosedError / DeadPeerError
        once the writer shut down / was lost and nothing is left to read."""
        return self._next(timeout, policy, take=False) is not None

    def read(self, timeout: float | None = None, policy: WaitPolicy | None = None):
        """The next message as a bytearray the caller owns, or None at the timeout."""
        return self._next(timeout, policy, take=True)

    def _next(self, timeout: float | None, policy: WaitPolicy | None, take: bool):
        """Wait until a message is held; then return True, or with `take` hand the message out (looking at once
        for the one after it, so the source stays signalled while ZeroMQ holds more). None at the timeout.

        A message taken and handed out in the same call never touches the eventfd, and ZeroMQ is looked at only
        after the wait (anything unread keeps the epoll descriptor readable, so the wait returns at once). After a
        wake-up the message is received at once, without reading ZMQ_EVENTS first (the receive processes
        ZeroMQ's commands itself when it must: one poll() in ZeroMQ instead of two), and once it is handed out,
        one ZMQ_EVENTS read looks for the next: a message costs the receive and one ZMQ_EVENTS read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Between calls the descriptor is readable whenever something may have arrived (see contract), so a call
        # that will wait goes straight to the wait, whose own first look is one poll() of the descriptor.
        woken = not (timeout is None or timeout > 0) or self._pending is not None
        waited = False  # woken by the wait: a message is almost surely there (see _take_message)
        while True:
            with self._lock:
                self._check_open()
                if woken:
                    self._take_message(probe=not waited)
                    if self._pending is None:
                        self._take_events()
                if self._pending is not None:
                    if take:
                        msg, self._pending = self._pending, None
                        self._take_message()
                    self._sync_signal()
                    return msg if take else True
                self._sync_signal()
            if self._shut_down:
                raise ClosedError(f"queue {self.name}: shut down by its writer and every message read")
            if self._lost:
                raise DeadPeerError(f"queue {self.name}: lost the connection to its writer at {self.address} (its "
                                    "process died or the network failed); every message received was read")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                wait_any([self._fd_source], timeout=left, policy=policy or self.DEFAULT_POLICY)
            except SourceError:
                if not self._cancelled:
                    raise  # closed by close() in another thread: the next drain raises ClosedError
            woken = waited = True

    def read_view(self, timeout: float | None = None, policy: WaitPolicy | None = None):
        """The next message as a read-only view, held until release()."""
        msg = self.read(timeout, policy)
        if msg is None:
            return None
        self._lent = memoryview(msg).toreadonly()
        return self._lent

    def release(self) -> None:
        self._lent = None

    def cancel_waits(self) -> None:
        """Any thread: every wait of this reader, running or later, ends with ClosedError."""
        self._cancelled = True
        with self._lock:  # never held across a wait: only while ZeroMQ is read
            if not self.closed:
                os.eventfd_write(self._cancel_fd, 1)  # wakes a thread waiting on the sockets

    def close(self) -> None:
        self.cancel_waits()  # a thread waiting on the sockets wakes (and then finds the reader closed)
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if os.getpid() != self._owner_pid:
                return
            self._release()

    def _release(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        for fd in (self._signal, self._cancel_fd):
            if fd is not None:
                os.close(fd)
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._zmq.release()

    # ---- internals ----

    def _drain(self) -> None:
        """Take what ZeroMQ holds without blocking (connection events, then at most one message), and signal the
        eventfd exactly while there is something to take."""
        try:
            self._take()
        finally:
            self._sync_signal()

    def _sync_signal(self) -> None:
        if self.closed:
            return
        want = self._pending is not None or self._shut_down or self._lost
        if want and not self._signalled:
            os.eventfd_write(self._signal, 1)
        elif not want and self._signalled:
            try:
                os.eventfd_read(self._signal)
            except BlockingIOError:
                pass
        self._signalled = want

    def _take(self) -> None:
        """Connection events, then at most one message (never blocks). Raises ClosedError once closed."""
        self._check_open()
        self._take_events()
        self._take_message()

    def _check_open(self) -> None:
        if self.closed or self._cancelled:
            raise ClosedError(f"queue {self.name}: this reader was closed or shut down")

    def _take_events(self) -> None:
        monitor = self._monitor
        # Reading ZMQ_EVENTS processes ZeroMQ's pending commands, which re-arms the descriptor; anything that
        # arrived meanwhile is announced only by that read (its signal was just consumed), so take it.
        while monitor.get(_EVENTS) & _POLLIN:
            event = zmq.utils.monitor.recv_monitor_message(monitor, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._lost = True

    def _take_message(self, probe: bool = True) -> None:
        """Receive one message into _pending, unless one is held; otherwise leave the descriptor re-armed.

        probe: read ZMQ_EVENTS first (a poll() in ZeroMQ, ~1.3 us measured here), and receive only if it says a
        message is there. Without (after a wake-up, when one almost always is), receive at once: a receive that
        finds nothing processes ZeroMQ's commands and re-arms the descriptor just as the ZMQ_EVENTS read does, but
        raises zmq.Again (~4 us in pyzmq), so it is worth it only where a message is likely."""
        if self._pending is not None or self._shut_down:
            return
        sock = self._sock
        if probe:
            if not sock.get(_EVENTS) & _POLLIN:
                return
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        else:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
        if not frame.more:  # a message of one part
            self._pending = [frame.buffer] if self._as_parts else bytearray(frame)
            return
        frames = [frame]
        while frames[-1].more:  # the rest of a multipart message is there already (ZeroMQ delivers it whole)
            frames.append(sock.recv(zmq.NOBLOCK, copy=False))
        kind = frames[0].bytes
        if kind == KIND_SHUTDOWN:
            self._shut_down = True
            return
        if kind != KIND_MESSAGE:
            raise ValueError(f"queue {self.name}: corrupt frame kind {kind!r} from {self.address}; "
                             "is another program publishing on this port?")
        if self._as_parts:
            self._pending = [f.buffer for f in frames[1:]]
            return
        size = sum(len(f.buffer) for f in frames[1:])
        msg = bytearray(size)
        off = 0
        for f in frames[1:]:
            n = len(f.buffer)
            msg[off:off + n] = f.buffer
            off += n
        self._pending = msg
