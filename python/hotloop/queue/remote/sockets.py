"""Socket settings both ends of a remote queue share: how long an unreachable peer is waited for (ZMTP heartbeats
with a timeout, and TCP keepalive, set by ``keepalive``), a reader's SUB socket, connection monitors on endpoints
of their own, and the address other nodes reach this one at. Each function only configures or makes a socket; none
blocks.
"""

from __future__ import annotations

import itertools
import os
import socket

import zmq

PEER_TIMEOUT_S = 3  # an unreachable peer's connection is given up after this long (HOTLOOP_PEER_TIMEOUT_S)
# A heartbeat from each end this often (see keepalive). Shorter: a vanished peer is seen sooner after the timeout
# (at most this much later) and a stopped peer is tolerated longer (the timeout less about half of it); longer:
# fewer segments, so fewer losses that must be retransmitted in time. At 0.5 s a partition was seen 3.4 s after the
# cut (p50; p99 3.55 s; 4.3 s with three runs on the 2 cores), and no live connection was lost in 12 min at 2 % or
# 5 % loss each way, nor in 57 cuts of 0.3-1.0 s (python -m hotloop.bench.loss_survival, docs/multi-node.md).
PING_INTERVAL_S = 0.5
# A reader's socket never reconnects (reader_socket). Not -1 ("never"): libzmq then ends the connection's session,
# and the messages it had received but the reader had not read yet were dropped with it.
NO_RECONNECT_MS = 2**31 - 1


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
    ``peer_timeout_s()`` on both ends, and keep one that only loses packets or is cut for a moment:

    - Heartbeats (ZMTP): each end sends a PING every ``PING_INTERVAL_S`` and answers the peer's with a PONG; an
      end that decodes nothing at all from its peer (no message, PING or PONG) for the peer timeout drops the
      connection (``ZMQ_HEARTBEAT_TIMEOUT``). (With only the writer sending PINGs, and the reader judging by
      their ``ZMQ_HEARTBEAT_TTL``, each verdict waited on a chain, the writer's retransmitted PING and then the
      PONG; the 45 s network soak at 2 % loss lost a relay's connection after two 0.8 s cuts.)
    - Neither end's ZeroMQ receive buffer is bounded (``ZMQ_RCVHWM`` 0; a writer's sends are bounded
      by its ``remote_hwm``): in libzmq 4.3.5 an end with heartbeats whose receive buffer is full (its reader
      behind) and whose connection is then reset writes a PING or a PONG on the closed connection and aborts the
      process ("Assertion failed: !_io_error (src/stream_engine_base.cpp:310)", zeromq/libzmq#4767, open:
      ZeroMQ marks the error only for a connection it had stopped reading; reproduced here, a reader 50 messages of
      64 KiB behind a writer that closed, every time). TCP retransmits a lost PING, so a false verdict needs one segment
      and every retransmission of it (0.2, 0.6, 1.4 s after it at the minimum RTO) lost, where keepalive probes
      (whole seconds, so two in a 3 s timeout) needed only two losses in a row: measured with
      ``python -m hotloop.bench.loss_survival`` (12 min, 6 idle queues, a busy one and 2 liveness links per
      loss level), keepalive alone lost 5 of 6 idle queues at 2 % loss each way and all 6 at 5 %; heartbeats
      lost none (docs/multi-node.md). A vanished peer is seen the timeout to the timeout + the interval after
      its last message.
    - No ``TCP_USER_TIMEOUT``: once a connection carrying heartbeats has recovered from one retransmission
      timeout, the next lost segment ended it at its first retransmission (ETIMEDOUT 0.25-0.4 s into a 0.5 s
      cut, in every trial, Linux 6.18; most likely the first episode's retransmission stamp is kept, and the
      timeout counted from it); without the option the same connections survived the same cuts. That is what made
      heartbeats with only the kernel's timers fatal in short cuts. The heartbeat timeout covers a writer
      with data in flight to a vanished reader, which ``TCP_USER_TIMEOUT`` covered before.
    - TCP keepalive (a probe a second after an idle second, ``timeout - 1`` of them) stays as a backstop for a
      connection that decodes nothing yet (the CurveZMQ handshake).

    A busy peer is not a lost one: its ZeroMQ I/O thread answers, whatever its application threads do. A peer is
    taken for lost when nothing of it arrives for the timeout although its node is up: its process stopped
    (SIGSTOP) for about ``timeout - PING_INTERVAL_S / 2`` or longer, or one message takes longer than the timeout
    to cross the link. A reader that is alive but does not read is not lost: its ZeroMQ I/O thread takes in
    what arrives (its buffer is not bounded, above), and the writer's enqueue waits once ``remote_hwm`` messages
    are queued for it. A peer whose process dies is seen at once: its kernel
    closes the connection."""
    timeout = peer_timeout_s()
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, timeout - 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(PING_INTERVAL_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout * 1000)
    sock.setsockopt(zmq.RCVHWM, 0)


def reader_socket(ctx: zmq.Context, server_public: bytes, client_keys: tuple[bytes, bytes]) -> zmq.Socket:
    """A reader's SUB socket, not yet connected: its rank's CurveZMQ client keys, the writer's server key (the
    handshake fails against any other server), no linger, the peer timeout (``keepalive``), and no reconnection
    (``NO_RECONNECT_MS``): a reader gives a lost connection up (DeadPeerError), and a SUB socket that reconnects
    after a heartbeat timeout that came while its receive buffer was full aborts the process in libzmq 4.3.5
    ("Assertion failed: _input_stopped", zeromq/libzmq#3937: the new connection is told to resume reading that
    the old one had stopped; reproduced here with ``remote_hwm=2`` and a reader idle for 5 s)."""
    sock = ctx.socket(zmq.SUB)
    try:
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = client_keys
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, NO_RECONNECT_MS)
        keepalive(sock)
    except BaseException:  # keys ZeroMQ refuses (not z85): a socket left open would hold the context's term()
        sock.close(linger=0)
        raise
    return sock
