"""Socket settings both ends of a remote queue share: how long an unreachable peer is waited for (TCP keepalive and
``TCP_USER_TIMEOUT``, set by ``keepalive``), a reader's SUB socket, connection monitors on endpoints of their own,
and the address other nodes reach this one at. Each function only configures or makes a socket; none blocks.
"""

from __future__ import annotations

import itertools
import os
import socket

import zmq

PEER_TIMEOUT_S = 3  # an unreachable peer's connection is given up after this long (HOTLOOP_PEER_TIMEOUT_S)


def default_connect_ip() -> str:
    """This node's address as other nodes reach it: $HOTLOOP_HOST_IP, else the outbound interface's address."""
    if ip := os.environ.get("HOTLOOP_HOST_IP"):
        return ip
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


_MONITOR_IDS = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """`sock`'s connection monitor, on an inproc endpoint of its own. Not pyzmq's default endpoint, named after the
    socket's descriptor: a socket closed a moment ago keeps its endpoint until ZeroMQ has reaped it (a writer's
    lingers while it sends what is queued), and a new socket given the same descriptor number then failed to
    monitor with "Address already in use"."""
    return sock.get_monitor_socket(events, addr=f"inproc://hotloop-monitor-{os.getpid()}-{next(_MONITOR_IDS)}")


def peer_timeout_s() -> int:
    """How long a remote peer may be unreachable before its connection is given up (whole seconds, >= 2):
    ``HOTLOOP_PEER_TIMEOUT_S``, default ``PEER_TIMEOUT_S``."""
    raw = os.environ.get("HOTLOOP_PEER_TIMEOUT_S", "")
    try:
        value = int(raw) if raw else PEER_TIMEOUT_S
    except ValueError:
        raise ValueError(f"HOTLOOP_PEER_TIMEOUT_S={raw!r}: give whole seconds, at least 2") from None
    if value < 2:
        raise ValueError(f"HOTLOOP_PEER_TIMEOUT_S={raw!r}: give whole seconds, at least 2")
    return value


def keepalive(sock: zmq.Socket) -> None:
    """Give up a connection whose peer's node vanished (no FIN or RST: power lost, a partition) within
    ``peer_timeout_s()``, by the kernel's TCP timers, on both ends:

    - an idle connection (a reader waiting for the next message): keepalive probes every second after one idle
      second, the connection dropped after ``timeout - 1`` unanswered ones;
    - a connection with data in flight (the writer sending to a partitioned reader; keepalive never probes
      then): ``TCP_USER_TIMEOUT`` (ZeroMQ's ``TCP_MAXRT``), the connection dropped once sent data stays
      unacknowledged that long. Without it the writer's kernel retransmits for about 15 minutes and its writes
      succeed into the send buffer all that time.

    A slow reader is not a dead one: its kernel acknowledges the writer's zero-window probes. Not ZMTP
    heartbeats: those travel in-band, so a reader that is busy (its receive buffer full, ZeroMQ no longer
    reading the socket) misses them and would be disconnected for being slow. A peer whose process dies is seen
    at once either way: its kernel closes the connection.

    Known limit: sustained packet loss can end a live idle connection. Keepalive intervals are whole seconds, so
    only two probes fit in the 3 s timeout; at 2 % loss each way both fail about once in 600 idle seconds (the
    soak's network run beside CPU load failed so once in 13 runs). ZMTP PINGs every 500 ms with no PONG awaited
    were tried: they ended live connections in short cuts instead (2 of 3 runs of the soak's network test
    failed so; most likely a PING lost in a 0.3-1 s cut, in flight where an idle connection had nothing, and
    TCP's doubling retransmission timer reaching the timeout before the resend that would have crossed after
    the cut), so they are not used."""
    timeout = peer_timeout_s()
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, timeout - 1)
    sock.setsockopt(zmq.TCP_MAXRT, timeout * 1000)


def reader_socket(ctx: zmq.Context, server_public: bytes, client_keys: tuple[bytes, bytes]) -> zmq.Socket:
    """A reader's SUB socket, not yet connected: its rank's CurveZMQ client keys, the writer's server key (the
    handshake fails against any other server), no linger, the peer timeout (``keepalive``)."""
    sock = ctx.socket(zmq.SUB)
    try:
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = client_keys
        sock.setsockopt(zmq.LINGER, 0)
        keepalive(sock)
    except BaseException:  # keys ZeroMQ refuses (not z85): a socket left open would hold the context's term()
        sock.close(linger=0)
        raise
    return sock
