"""``RemoteSubscriber``: a remote queue's reader end, one SUB socket behind one waitable descriptor (see the package's
contract, ``__init__.py``).

It has the reader surface of a shared-memory ring. The sockets are made here with pyzmq (keys, subscriptions,
connect, the connection monitor); the hot path runs in C++ (``_core.ZmqReader``, csrc/hotloop/zmq_reader.h): the
wait, the receive, the look for the next message and the copy into the caller's buffer, in one call with the GIL
released, through the libzmq pyzmq loaded. Its lock makes ``read``, ``readable`` and ``close`` safe from several
threads; ``cancel_waits`` and ``close`` end a wait in another thread. Only a wait blocks (in ``wait_any``); every
other operation takes what ZeroMQ holds without blocking.
"""

from __future__ import annotations

import os

import zmq

from hotloop._core import FdSource, WaitPolicy, ZmqReader
from hotloop.queue.remote.context import OPEN_ENDS, ProcessZmq
from hotloop.queue.remote.sockets import monitor_socket, reader_socket
from hotloop.queue.remote.wire import rank_topic


class RemoteSubscriber:
    # A network reader's default wait: park at once, no spin. Its messages come through ZeroMQ's I/O thread in
    # this process, which needs a CPU to receive and decrypt them; a spinning reader competes with it (64 B round
    # trip between two processes over TCP loopback on a shared 2-core machine, same run: 69 us parked, 99 us
    # spinning 20 us first; hotloop.bench.remote_round_trip, 4 repetitions, twice: p50 69 us parked,
    # 135-144 us spinning 30 us first), and spinning on a descriptor is a poll() system call per check anyway. A
    # policy passed to MessageQueue.create_from_handle replaces it.
    DEFAULT_POLICY = WaitPolicy(spin_us=0, yield_us=0)

    def __init__(self, address: str, rank: int, queue_name: str, server_public: bytes,
                 client_keys: tuple[bytes, bytes], topic: bytes | None = None):
        """Reader `rank`'s data connection; `topic` is what it tells the writer it is (default: the rank's own
        topic; a node's relay passes the node's, and forwards its messages with forward())."""
        self.name = queue_name
        self.address = address
        self._owner_pid = os.getpid()
        self._zmq = ProcessZmq.acquire()
        self._sock = self._monitor = self._core = None
        try:
            self._connect(address, topic or rank_topic(rank), server_public, client_keys)
        except BaseException:  # a reader that cannot start leaves no sockets, descriptors or threads behind
            self._release()
            raise
        OPEN_ENDS.add(self)
        self._lent: memoryview | None = None
        self.closed = False

    def _connect(self, address, topic, server_public, client_keys) -> None:
        self._sock = reader_socket(self._zmq.ctx, server_public, client_keys)
        self._monitor = monitor_socket(self._sock, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.connect(address)
        # The hot path: it borrows both sockets (closed here, in _release, once it let go of them) and owns the
        # epoll set every wait sleeps on, the signal eventfd and the cancel eventfd (see the package's contract).
        self._core = ZmqReader(self._sock.underlying, self._monitor.underlying, self.name, address)
        self._fd_source = FdSource(self._core.fd)

    # ---- the reader surface shared with ShmRing ----

    def readable(self) -> bool:
        """Whether a message is waiting, or the stream ended (the writer shut down or was lost: the next read
        raises), as the source says; never blocks. (A caller that waits on the source and then asks readable()
        must not find the source ready and nothing to take: it would spin.)"""
        return self._core.readable()

    @property
    def source(self) -> FdSource:
        """The wait_any source: the epoll descriptor, the same object every time (see contract)."""
        self._core.readable()
        return self._fd_source

    def wait_readable(self, timeout: float | None = None, policy: WaitPolicy | None = None) -> bool:
        """Wait until a message is waiting: True, or False at the timeout. Raises ClosedError / DeadPeerError
        once the writer shut down / was lost and nothing is left to read."""
        return self._core.wait_readable(timeout, policy or self.DEFAULT_POLICY)

    def read(self, timeout: float | None = None, policy: WaitPolicy | None = None):
        """The next message as a writable buffer the caller owns (a memoryview, as a shared-memory reader's), or
        None at the timeout."""
        return self._core.read(timeout, policy or self.DEFAULT_POLICY)

    def forward(self, ring, write_policy: WaitPolicy) -> None:
        """A node's relay: wait for the next message and write it into `ring` (a ShmRing), both with the GIL
        released; raises as read() and ring.write do."""
        self._core.forward(ring, self.DEFAULT_POLICY, write_policy)

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
        self._core.cancel()

    def close(self) -> None:
        """Any thread, idempotent: a wait in another thread ends with ClosedError; the sockets are closed once the
        hot path has let go of them (a forked copy leaves its parent's alone)."""
        owner = os.getpid() == self._owner_pid
        self.closed = True  # before the wait in another thread ends: it may ask (a relay does)
        if not self._core.close(owner):
            return
        if owner:
            self._release()

    def _release(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._zmq.release()
