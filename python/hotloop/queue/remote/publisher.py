"""``RemotePublisher``: a remote queue's writer end, one XPUB socket (see the package's contract, ``__init__.py``).

One thread writes (``write``, ``shutdown``, ``close``); ``poll_peers`` is called from that thread too. ``write``
blocks only while a reader is ``hwm`` messages behind, up to its timeout; it takes in subscription changes and
refused handshakes every ``PEER_CHECK_EVERY`` writes and every ``PEER_CHECK_INTERVAL``. ``close`` waits for the
socket's queued messages to go out, up to ``writer_linger_s()``. The socket is set up here with pyzmq (CurveZMQ, ZAP,
bind) and its subscriptions and monitor read here (``poll_peers``); a message's framing and send, and the count
that says when to look at the peers, run in C++ (``_core.ZmqWriter``, csrc/hotloop/zmq_writer.h) with the GIL
released, through the libzmq pyzmq loaded.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import termios
import time

import zmq
import zmq.utils.monitor

from hotloop._core import ClosedError, DeadPeerError, ZmqWriter
from hotloop.queue.remote.context import OPEN_ENDS, ProcessZmq
from hotloop.queue.remote.curve import new_keys
from hotloop.queue.remote.sockets import default_connect_ip, keepalive, monitor_socket, peer_timeout_s
from hotloop.queue.remote.wire import KIND_SHUTDOWN, NODE_TOPIC, parse_rank_topic, rank_topic

# A writer takes in subscription changes and refused handshakes at least every this many sends and this often: a
# look reads ZMQ_EVENTS or receives (each a system call in ZeroMQ, ~1.2 us measured on this project's 2-core
# machines, where a 64 B send costs 0.4 us), and finding a reader's departure a few milliseconds later changes
# nothing but when write() raises. A whole look (poll_peers: the refused handshakes, then the subscriptions)
# measured 18-32 us p50 on a loaded machine when it received until zmq.Again, so at a GPU step cadence (a write
# every 1.4 ms) a 2 ms interval made every other step's broadcast pay it; at 10 ms it is one in seven (a lost node
# is bounded by the peer timeout, seconds, anyway). A look that finds nothing now reads ZMQ_EVENTS only (5 us p50
# quiet, against 8.5): the 64 B remote round trip's p99 went from 1.40-1.47x to 1.17-1.18x CURVE PUB/SUB's.
PEER_CHECK_EVERY = 64
PEER_CHECK_INTERVAL = 0.010  # seconds
# How often a closing writer looks at its connections' unacknowledged bytes (and at once on any monitor event).
DRAIN_CHECK_INTERVAL = 0.005  # seconds
_CONNECTION = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

log = logging.getLogger("hotloop.queue.remote")


def writer_linger_s() -> float:
    """The longest a closing writer waits for its readers to take in what was sent and queued for them, first for
    their kernels' acknowledgements (``_wait_until_acknowledged``), then in ZeroMQ's LINGER: the peer timeout and
    a second more. close() returns sooner, once each connection has acknowledged all it was sent or was given up.
    A reader whose connection is alive is taking messages in (its process takes in what arrives; the heartbeat
    gives up, within the peer timeout, one whose process stopped or whose node vanished), so a live reader that is
    slow (a lossy link, a loaded host, a process stopped for a moment) gets the tail when it catches up within
    this, and a dead one costs no more than this. (Each of close's two waits takes up to this bound, so at 30 s a
    close could outlast the soak's 30 s hang check, and did once in 71 generations of the 10-minute soak at 5 %
    loss, after a partition; the bound stays where a hang cannot hide.)"""
    return peer_timeout_s() + 1.0


class RemotePublisher:
    def __init__(self, queue_name: str, ranks: range, connect_ip: str | None = None, bind_ip: str | None = None,
                 dead_reader: str = "raise", hwm: int = 1000):
        self.queue_name = self.name = queue_name
        self.ranks = ranks
        self.dead_reader = dead_reader
        self._owner_pid = os.getpid()
        (self.server_public, server_secret), self.client_keys = new_keys(ranks)
        self._zmq = ProcessZmq.acquire()
        self._sock = self._monitor = None
        try:
            self._open(server_secret, connect_ip, bind_ip, hwm)
        except BaseException:  # a writer that cannot start leaves no sockets or ZAP domain behind
            self._release()
            raise
        OPEN_ENDS.add(self)
        self.attached: set[int] = set()
        self._subscribers: dict[int, int] = {}  # rank -> readers subscribed as that rank
        self.dead: list[int] = []  # ranks that left, not yet reported
        self.twice: list[int] = []  # ranks attached by a second reader
        self.rejected_peers = 0  # connections refused: no CURVE, a wrong server key, or an unknown client key
        self.ignored_frames = 0  # malformed or forged subscription frames from authenticated peers
        self._topics = {rank_topic(r): r for r in ranks}
        self._node_of: dict[int, str] = {}  # relayed rank -> its node (from its presence subscription)
        self._relays: dict[str, int] = {}  # node -> relay streams subscribed for it
        self.relay_rank: dict[str, int] = {}  # node -> the rank whose process runs its relay
        self._lost_relay: dict[int, str] = {}  # rank -> node, for ranks in `dead` because their relay went
        self.is_shut_down = False

    def _open(self, server_secret: bytes, connect_ip: str | None, bind_ip: str | None, hwm: int) -> None:
        self._zap_domain = self._zmq.admit({pub: r for r, (pub, _) in zip(self.ranks, self.client_keys)})
        self._sock = self._zmq.ctx.socket(zmq.XPUB)
        self._sock.curve_server = True
        self._sock.curve_secretkey = server_secret
        self._sock.curve_publickey = self.server_public
        self._sock.zap_domain = self._zap_domain.encode()
        self._sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # every subscribe and unsubscribe reaches us
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)  # a slow reader makes send wait instead of losing messages
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, int(writer_linger_s() * 1000))
        keepalive(self._sock)
        self._monitor = monitor_socket(self._sock, _HANDSHAKE_FAILED | _CONNECTION | zmq.EVENT_MONITOR_STOPPED)
        self._connection_fds: set[int] = set()  # the TCP connections ZeroMQ accepted and has not dropped
        connect_ip = connect_ip or default_connect_ip()
        port = self._sock.bind_to_random_port(f"tcp://{bind_ip or connect_ip}")
        self.address = f"tcp://{connect_ip}:{port}"
        # The hot path (borrows the socket; counts the sends between looks at the peers).
        self._core = ZmqWriter(self._sock.underlying, self.queue_name, PEER_CHECK_EVERY, PEER_CHECK_INTERVAL)

    def _release(self) -> None:
        if getattr(self, "_zap_domain", None) is not None:
            self._zmq.forget(self._zap_domain)
        if self._sock is not None:
            if self._monitor is not None and os.getpid() == self._owner_pid:
                self._wait_until_acknowledged()
            self._sock.close()  # ZeroMQ's I/O thread still sends what is queued, for up to LINGER
            if self._monitor is not None:
                self._wait_until_sent()
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._zmq.release()

    def _wait_until_acknowledged(self) -> None:
        """Before close: wait until every live connection's peer has acknowledged all this writer sent (the
        kernel's unacknowledged send bytes, SIOCOUTQ, are 0 on each), or the connection was dropped, up to
        ``writer_linger_s()``. ZeroMQ's LINGER only covers messages not yet handed to the kernel: once they are,
        ZeroMQ closes the connection, and a peer's heartbeat that arrived since is unread data, so the kernel
        resets the connection and throws away what the peer had not acknowledged yet (Linux also resets an
        orphaned connection that receives data, a PONG after the close; measured: a reader 3 MB behind lost its
        last 49 messages of 64 KiB every time, with DeadPeerError in place of ClosedError). A message still in
        ZeroMQ's buffers is handed to the kernel as soon as it has room, so all-acknowledged is looked for twice in
        a row. A dead peer's connection is dropped by the heartbeat (``sockets.keepalive``), which ends the wait
        for it."""
        deadline = time.monotonic() + writer_linger_s()
        quiet_looks = unacknowledged = 0
        while quiet_looks < 2 and (left := deadline - time.monotonic()) > 0:
            self._drain_monitor()
            unacknowledged = sum(_unacknowledged_bytes(fd) for fd in self._connection_fds)
            quiet_looks = quiet_looks + 1 if unacknowledged == 0 else 0
            if quiet_looks < 2:
                self._monitor.poll(max(1, int(min(left, DRAIN_CHECK_INTERVAL) * 1000)))
        if quiet_looks < 2 and unacknowledged:
            log.warning("queue %s: closing with %d bytes sent to remote readers not acknowledged after %.1f s; "
                        "a reader that is alive but this far behind loses them", self.queue_name, unacknowledged,
                        writer_linger_s())
        elif quiet_looks < 2:  # the bound passed before a second look could confirm the first's nothing
            log.warning("queue %s: closing after %.1f s with every reader's acknowledgement seen once, not confirmed; "
                        "a message still in ZeroMQ's buffers may not reach a reader that is alive", self.queue_name,
                        writer_linger_s())

    def _wait_until_sent(self) -> None:
        """After close: wait until ZeroMQ destroyed the socket, which it does once every queued message went out
        (or LINGER passed); its monitor says so with MONITOR_STOPPED. The process's context may serve other queue
        ends and so is not terminated here, which is what would otherwise wait for this."""
        wait_s = writer_linger_s() + 1.0
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._monitor.poll(int(left * 1000) + 1):
                break
            event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
        log.warning("queue %s: the remote writer's socket was not released within %.1f s of close()",
                    self.queue_name, wait_s)

    def poll_peers(self) -> None:
        """Take in every subscription change and refused handshake that arrived (never blocks). Where nothing
        arrived (the usual look: each socket's ZMQ_EVENTS, which also has ZeroMQ take in its pending commands), it
        costs two option reads and no receive (a receive that finds nothing raises zmq.Again: 8.5 us a look
        against 5 us, p50 on a quiet 2-vCPU VM)."""
        self._core.peers_checked()
        if self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._drain_monitor()
        if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = frame.bytes
            topic = msg[1:]
            if topic == b"" and msg[:1] in (b"\x00", b"\x01"):
                continue  # the everything-subscription of a reader's (or a relay's) data connection
            if msg[:1] not in (b"\x00", b"\x01"):
                self._ignore(f"a malformed subscription frame {msg[:40]!r}")
                continue
            # A peer's own frames carry the rank its key authenticated as; an unsubscription that libzmq
            # makes when a connection ends carries none (it repeats that connection's own subscriptions).
            peer = _user_id(frame)
            subscribe = msg[0] == 1
            if subscribe and peer is None:
                self._ignore(f"a subscription {msg[:40]!r} without an authenticated peer")
                continue
            if topic.startswith(NODE_TOPIC):
                self._take_relay(topic[len(NODE_TOPIC):].decode(errors="replace"), subscribe, peer)
                continue
            rank, node = parse_rank_topic(topic, self._topics)
            if rank is None:
                self._ignore(f"a malformed subscription frame {msg[:40]!r}")
                continue
            if peer is not None and peer != str(rank):
                self._ignore(f"a subscription for rank {rank} from a peer authenticated as rank {peer}")
                continue
            n = self._subscribers.get(rank, 0) + (1 if subscribe else -1)
            self._subscribers[rank] = n
            if subscribe:
                if n > 1:
                    self.twice.append(rank)
                if node is not None:
                    self._node_of[rank] = node
                if node is None or self._relays.get(node, 0) > 0:
                    self.attached.add(rank)
            elif n == 0:
                if rank in self.attached:
                    self.attached.discard(rank)
                    self.dead.append(rank)
                elif self._node_of.get(rank) is not None:  # it left before its node's relay was in
                    self.dead.append(rank)

    def _take_relay(self, node: str, subscribe: bool, peer: str | None) -> None:
        """A node's relay stream came (or went): the node's ranks are attached once it and they are in, and are
        all lost when it goes."""
        if peer is not None and not (peer.lstrip("-").isdigit() and int(peer) in self.ranks):
            self._ignore(f"a relay subscription for node {node!r} from a peer authenticated as rank {peer}")
            return
        n = self._relays.get(node, 0) + (1 if subscribe else -1)
        self._relays[node] = max(n, 0)
        if subscribe:
            if peer is not None:
                self.relay_rank[node] = int(peer)
            for rank, rank_node in self._node_of.items():
                if rank_node == node and self._subscribers.get(rank, 0) > 0:
                    self.attached.add(rank)
        elif n == 0:
            for rank, rank_node in sorted(self._node_of.items()):
                if rank_node == node and rank in self.attached:
                    self.attached.discard(rank)
                    self.dead.append(rank)
                    self._lost_relay[rank] = node

    def _ignore(self, what: str) -> None:
        self.ignored_frames += 1
        if self.ignored_frames <= 10 or self.ignored_frames % 1000 == 0:
            log.warning("queue %s: ignored %s (%d so far); the writer carries on", self.queue_name, what,
                        self.ignored_frames)

    def _drain_monitor(self) -> None:
        """Take in the connections accepted and dropped since the last look (their descriptors), and count and log
        the handshakes refused (strangers never reach the data socket)."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._connection_fds.add(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._connection_fds.discard(event["value"])
            elif event["event"] & _HANDSHAKE_FAILED:
                self.rejected_peers += 1
                if self.rejected_peers <= 10 or self.rejected_peers % 1000 == 0:
                    log.warning("queue %s: refused a connection to %s that did not authenticate as one of its "
                                "readers (%d refused so far); readers need this queue's handle",
                                self.queue_name, event["endpoint"].decode(errors="replace"), self.rejected_peers)

    def _check_peers(self) -> None:
        if self.twice:
            rank = self.twice.pop()
            raise DeadPeerError(f"queue {self.queue_name}: remote reader rank {rank} attached twice; give each "
                                "reader process its own rank")
        if self.dead:
            rank = self.dead.pop(0)
            node = self._lost_relay.pop(rank, None)
            if self.dead_reader == "raise":
                if node is not None:
                    raise DeadPeerError(
                        f"queue {self.queue_name}: remote reader rank {rank} on node {node!r} lost its node's relay "
                        f"(in rank {self.relay_rank.get(node, '?')}'s process: it died, closed, or nothing came from "
                        "the node for the peer timeout); restart the node's readers, or create the queue with "
                        "dead_reader='drop'")
                where = f" on node {self._node_of[rank]!r}" if self._node_of.get(rank) else ""
                raise DeadPeerError(f"queue {self.queue_name}: remote reader rank {rank}{where} disconnected (its "
                                    "process died, it closed, or nothing came from its node for the peer timeout); "
                                    "restart it, or create the queue with dead_reader='drop'")
            self._check_peers()  # dropped: the rank is simply forgotten; report any other

    @property
    def n_readers(self) -> int:
        return len(self.ranks)

    @property
    def attached_readers(self) -> int:
        return len(self.attached)

    def wait_all_attached(self, timeout: float | None, policy=None) -> bool:
        """Wait until every remote rank is attached (in ZeroMQ's poll: `policy` is not used). Raises DeadPeerError
        for a rank attached twice."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll_peers()
            if self.twice:
                self._check_peers()
            if self.attached >= set(self.ranks):
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._sock.poll(None if left is None else max(1, int(left * 1000)), zmq.POLLIN)

    def write(self, parts, timeout: float | None, policy=None) -> None:
        """Publish one message (its parts are copied once into ZeroMQ's buffers; `policy` is not used: a full send
        buffer is waited for in ZeroMQ). Raises QueueTimeout when a reader stays a full send buffer behind."""
        if self.is_shut_down:
            raise ClosedError(f"queue {self.queue_name}: enqueue after shutdown()")
        if self._core.check_due():
            self.poll_peers()
        if self.dead or self.twice:
            self._check_peers()
        if not self.attached:
            self.poll_peers()  # a reader of a dropped rank may have come back since the last look
            if not self.attached:
                return  # every remote reader left (dropped): nothing to send to
        self._core.send(parts, timeout)

    def shutdown(self) -> None:
        """Tell every remote reader that no message follows (best effort: a reader gone already misses it)."""
        if self.is_shut_down or os.getpid() != self._owner_pid:
            return
        self.is_shut_down = True
        try:
            self._core.send_frames([KIND_SHUTDOWN, b""], 1.0)
        except TimeoutError:
            pass

    def close(self) -> None:
        """Shut down (the owner process) and release; idempotent."""
        if self._sock is None:
            return
        self.shutdown()
        if os.getpid() == self._owner_pid:  # a forked copy leaves the parent's sockets alone
            self._release()
        self.is_shut_down = True  # write() raises ClosedError from now on: the hot path's socket is gone
        self._sock = self._core = None


def _unacknowledged_bytes(fd: int) -> int:
    """Bytes sent on TCP connection `fd` that its peer has not acknowledged yet (0 for a descriptor that is no
    longer a connection: ZeroMQ closed it before its monitor said so)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]  # SIOCOUTQ on a socket
    except OSError:
        return 0


def _user_id(frame: zmq.Frame) -> str | None:
    """The rank a frame's connection authenticated as; None for a frame libzmq made itself (no metadata)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:  # EINVAL: the frame carries no metadata
        return None
