"""Liveness links: one TCP connection between the engine and each rank that carries only heartbeats, so that either
end learns within the peer timeout (``HOTLOOP_PEER_TIMEOUT_S``, default 3 s) that the other's node
stopped answering (a partition, a node that lost power), wherever its own threads are blocked (a rank in a
collective with a peer that is cut off, the engine waiting for a step's answer that will never come).

Contract:

- The rank's end: ``listen(ip)`` gives a listening socket on `ip`; ``hold(listener, token, timeout, on_lost)``
  (for a daemon thread) accepts the first connection that presents `token` within `timeout` (others are closed
  unread), then blocks on it and calls ``on_lost(why)`` once it ends, however: ``why`` is None when the engine
  closed it (its shutdown, or its process ended), else what happened (its node unanswered for the peer timeout).
- The engine's end: ``LinkWatcher(on_lost)``; ``connect(rank, ip, port, token, timeout)`` opens rank's link;
  ``start()`` runs one thread that blocks in ``poll`` on every link and a wake-up pipe, waking to send the
  heartbeats and to judge them, and calls ``on_lost(rank, why)`` when a link times out or becomes unreachable. A
  link closed or reset by its peer is not reported: that rank's process ended, which the caller learns from its
  supervisor with the reason.
  ``close()`` wakes and joins the thread and closes every descriptor; idempotent.
- Only the token (engine to rank, first) and heartbeat bytes travel on a link; nothing received is interpreted.
- Heartbeats: each end sends a byte every ``PING_INTERVAL_S`` and gives the link up once one of its bytes stays
  unacknowledged for the peer timeout (``_Beats``). The acknowledgements come from the peer's kernel, so a busy
  process, one that holds the GIL for seconds or one that is stopped is not taken for lost; TCP retransmits a lost
  byte (linear timeouts), so sustained packet loss and cuts of about a second do not end the link
  (``python -m hotloop.bench.loss_survival``: no link lost in 12 min at 2 % or 5 % loss each way, where keepalive
  probes alone lost every link; docs/multi-node.md). A vanished node is seen the timeout to the timeout + the
  interval after the cut.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hmac
import os
import select
import socket
import struct
import termios
import threading
import time

from hotloop.queue.remote import peer_timeout_s

HANDSHAKE_TIMEOUT_S = 1.0  # a connection that does not present the token within this long is closed


PING_INTERVAL_S = 0.5  # each end sends a byte this often (the queue's heartbeat interval, sockets.PING_INTERVAL_S)
_TCP_THIN_LINEAR_TIMEOUTS = 16  # linux/tcp.h (not in Python's socket module)


class _Beats:
    """One end's heartbeats on a link: a byte every ``PING_INTERVAL_S``; the peer's node is lost once a byte sent
    stays unacknowledged for the peer timeout. The acknowledgements come from the peer's kernel, so a peer process
    that is stopped, or that holds the GIL for seconds, still answers; and this end's own pauses cost nothing
    (what its peer acknowledged meanwhile is not outstanding when it looks). The kernel's ``TCP_USER_TIMEOUT``
    would judge the same but is not used: after one retransmission timeout, the next lost byte ended the link
    within 0.4 s of a 0.5 s cut (hotloop.queue.remote.sockets.keepalive). Linear retransmission timeouts for this
    thin stream: a lost byte is resent every ~0.2 s for six tries, not at 0.2, 0.6, 1.4 s."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.timeout = peer_timeout_s()
        self.sent = 0  # bytes sent after the token
        self.unacked: collections.deque = collections.deque()  # (bytes sent up to this one, when), oldest first
        self.next_ping = time.monotonic()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # the handshake's backstop, as the queue's
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.timeout - 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each byte at once: a later one marks a loss
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_THIN_LINEAR_TIMEOUTS, 1)
        except OSError:  # not Linux: exponential backoff, fewer tries in the timeout
            pass

    def due(self, now: float) -> float:
        """When this end must next act: send, or judge its oldest unacknowledged byte."""
        return min(self.next_ping, self.unacked[0][1] + self.timeout) if self.unacked else self.next_ping

    def tick(self, now: float) -> bool:
        """Send a heartbeat if one is due; False once a byte stayed unacknowledged for the timeout."""
        outstanding = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        while self.unacked and self.unacked[0][0] <= self.sent - outstanding:
            self.unacked.popleft()
        if self.unacked and now - self.unacked[0][1] >= self.timeout:
            return False
        if now >= self.next_ping:
            try:
                if self.sock.send(b"\0", socket.MSG_DONTWAIT):
                    self.sent += 1
                    self.unacked.append((self.sent, now))
            except BlockingIOError:  # a full send buffer: what is in it is judged
                pass
            self.next_ping = max(self.next_ping + PING_INTERVAL_S, now)
        return True


def _silent(whose: str = "its") -> str:
    return f"{whose} node did not answer for {peer_timeout_s()} s (a network partition, or the node is down)"


def _lost(e: OSError, whose: str = "its") -> str:
    if e.errno == errno.ETIMEDOUT:
        return _silent(whose)
    return f"{whose} node is unreachable ({e.strerror})"


def listen(ip: str) -> socket.socket:
    listener = socket.socket()
    listener.bind((ip, 0))
    listener.listen(8)
    return listener


def hold(listener: socket.socket, token: bytes, timeout: float, on_lost) -> None:
    """Accept the engine's link on `listener` (closed here), then wait on it until it ends: ``on_lost(why)``."""
    listener.settimeout(timeout)
    try:
        while True:
            conn, _ = listener.accept()
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                if hmac.compare_digest(conn.recv(len(token), socket.MSG_WAITALL), token):
                    break
            except OSError:
                pass
            conn.close()
    except OSError:  # the engine never connected: its start failed, and it removes this rank
        return
    finally:
        listener.close()
    conn.settimeout(None)
    beats = _Beats(conn)
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    try:
        while True:
            if not beats.tick(time.monotonic()):
                why = _silent("the engine's")
                break
            if poller.poll(max(1, int((beats.due(time.monotonic()) - time.monotonic()) * 1000) + 1)):
                if not conn.recv(4096):  # the engine's heartbeats are read and dropped
                    why = None  # the engine closed it
                    break
    except OSError as e:
        why = None if e.errno == errno.ECONNRESET else _lost(e, "the engine's")
    conn.close()
    on_lost(why)


class LinkWatcher:
    def __init__(self, on_lost):
        self.on_lost = on_lost
        self.links: dict[int, socket.socket] = {}
        self._wake: tuple[int, int] | None = None  # the pipe that stops the thread
        self._thread: threading.Thread | None = None

    def connect(self, rank: int, ip: str, port: int, token: bytes, timeout: float) -> None:
        sock = socket.create_connection((ip, port), timeout=timeout)
        self.links[rank] = sock
        sock.sendall(token)
        sock.settimeout(None)

    def start(self) -> None:
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="hotloop-liveness", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake[0], select.POLLIN)
        ranks = {sock.fileno(): rank for rank, sock in self.links.items()}
        beats = {fd: _Beats(self.links[rank]) for fd, rank in ranks.items()}
        for fd in ranks:
            poller.register(fd, select.POLLIN)
        while ranks:
            for fd in list(ranks):
                try:
                    alive = beats[fd].tick(time.monotonic())
                except OSError as e:
                    self._drop(poller, ranks, beats, fd, None if e.errno == errno.ECONNRESET else _lost(e))
                    continue
                if not alive:  # a heartbeat unacknowledged for the timeout: its node is cut off or down
                    self._drop(poller, ranks, beats, fd, _silent())
            if not ranks:
                return
            wake_at = min(b.due(0.0) for b in beats.values())
            for fd, _ in poller.poll(max(1, int((wake_at - time.monotonic()) * 1000) + 1)):
                if fd == self._wake[0]:
                    return
                if fd not in ranks:
                    continue
                try:
                    if self.links[ranks[fd]].recv(4096):
                        continue  # the rank's heartbeats: read and dropped
                    why = None  # closed by its peer: the rank's process ended
                except OSError as e:
                    why = None if e.errno == errno.ECONNRESET else _lost(e)
                self._drop(poller, ranks, beats, fd, why)

    def _drop(self, poller, ranks: dict, beats: dict, fd: int, why: str | None) -> None:
        poller.unregister(fd)
        rank = ranks.pop(fd)
        beats.pop(fd)
        if why is not None:
            self.on_lost(rank, why)

    def close(self) -> None:
        if self._wake is not None:
            os.write(self._wake[1], b"x")
            self._thread.join()
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        for sock in self.links.values():
            sock.close()
        self.links = {}
