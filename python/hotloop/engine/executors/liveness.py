"""Liveness links: one idle TCP connection between the engine and each rank, watched by the kernel's TCP timers, so
that either end learns within the peer timeout (``HOTLOOP_PEER_TIMEOUT_S``, default 3 s) that the other's node
stopped answering (a partition, a node that lost power), wherever its own threads are blocked (a rank in a
collective with a peer that is cut off, the engine waiting for a step's answer that will never come).

Contract:

- The rank's end: ``listen(ip)`` gives a listening socket on `ip`; ``hold(listener, token, timeout, on_lost)``
  (for a daemon thread) accepts the first connection that presents `token` within `timeout` (others are closed
  unread), then blocks on it and calls ``on_lost(why)`` once it ends, however: ``why`` is None when the engine
  closed it (its shutdown, or its process ended), else what happened (its node unanswered for the peer timeout).
- The engine's end: ``LinkWatcher(on_lost)``; ``connect(rank, ip, port, token, timeout)`` opens rank's link;
  ``start()`` runs one thread that blocks in ``poll`` on every link and a wake-up pipe (no timer) and calls
  ``on_lost(rank, why)`` when a link times out or becomes unreachable. A link closed or reset by its peer is not
  reported: that rank's process ended, which the caller learns from its supervisor with the reason.
  ``close()`` wakes and joins the thread and closes every descriptor; idempotent.
- Only the token ever travels on a link (engine to rank); nothing received is interpreted.
- The timers are the remote queue's (``hotloop.queue.remote.sockets.keepalive``): keepalive probes every second on the
  idle link, dropped after ``peer_timeout_s() - 1`` unanswered ones, and ``TCP_USER_TIMEOUT`` for data left
  unacknowledged.
  A busy process is never taken for a lost one: its kernel answers the probes.
"""

from __future__ import annotations

import errno
import hmac
import os
import select
import socket
import threading

from hotloop.queue.remote import peer_timeout_s

HANDSHAKE_TIMEOUT_S = 1.0  # a connection that does not present the token within this long is closed


def _keepalive(sock: socket.socket) -> None:
    timeout = peer_timeout_s()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, timeout - 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout * 1000)


def _lost(e: OSError, whose: str = "its") -> str:
    if e.errno == errno.ETIMEDOUT:
        return f"{whose} node did not answer for {peer_timeout_s()} s (a network partition, or the node is down)"
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
    _keepalive(conn)
    try:
        while conn.recv(4096):
            pass
        why = None
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
        _keepalive(sock)

    def start(self) -> None:
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="hotloop-liveness", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake[0], select.POLLIN)
        ranks = {sock.fileno(): rank for rank, sock in self.links.items()}
        for fd in ranks:
            poller.register(fd, select.POLLIN)
        while ranks:
            for fd, _ in poller.poll():
                if fd == self._wake[0]:
                    return
                try:
                    if self.links[ranks[fd]].recv(4096):
                        continue  # a rank sends nothing: ignored
                    why = None  # closed by its peer: the rank's process ended
                except OSError as e:
                    why = None if e.errno == errno.ECONNRESET else _lost(e)
                poller.unregister(fd)
                rank = ranks.pop(fd)
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
