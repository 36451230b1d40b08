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
PING_INTERVAL_MS = 500  # a ZMTP PING from each end this often: traffic that TCP retransmits (see keepalive)
PONG_WAIT_MS = 3_600_000  # never disconnect for a missing PONG: the kernel's timers decide (see keepalive)


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
    ``peer_timeout_s()``, by the kernel's TCP timers, on both ends, and keep one that only loses packets:

    - Every connection carries traffic, idle or not: a ZMTP PING every ``PING_INTERVAL_MS`` from each end (the
      peer's ZeroMQ answers with a PONG). Lost segments are retransmitted; one is given up only after about
      four losses in a row, so 2 % packet loss does not end a live connection. (Keepalive probes alone did:
      with whole-second probe intervals only two fit in the timeout, and both were lost about once in 600
      idle seconds at 2 % loss each way; an idle rank's connection then ended with DeadPeerError.)
    - ``TCP_USER_TIMEOUT`` (ZeroMQ's ``TCP_MAXRT``): the connection is dropped once sent data (a message, a
      PING) stays unacknowledged that long: a vanished peer is seen ``timeout`` to ``timeout`` + the interval
      after it vanished. Without it the writer's kernel retransmits for about 15 minutes and its writes succeed
      into the send buffer all that time.
    - TCP keepalive (a probe a second after an idle second), for the moments between PINGs.

    A slow reader is not a dead one: its kernel acknowledges the writer's zero-window probes, and no PONG is
    waited for (the heartbeat timeout is an hour: a reader that is busy, its receive buffer full and ZeroMQ no
    longer reading the socket, answers no PING and must not be disconnected for being slow). A peer whose
    process dies is seen at once either way: its kernel closes the connection."""
    timeout = peer_timeout_s()
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, timeout - 1)
    sock.setsockopt(zmq.TCP_MAXRT, timeout * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, PING_INTERVAL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PONG_WAIT_MS)


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
