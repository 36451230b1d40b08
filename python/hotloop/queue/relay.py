"""A node's relay: the remote readers that share a node share one stream from the writer.

Contract:

- A remote reader names its node (``MessageQueue.create_from_handle(..., node=...)``; default ``node_id()``, the
  host's name and boot id). Readers of one queue that name the same node share one CurveZMQ stream: the first
  of them to arrive becomes the node's relay. It creates a shared-memory ring with a slot per remote rank of the
  queue, publishes it under a name every reader derives from the queue's name and the node's, connects to the
  writer with its own rank's key and subscribes to everything and to the node's topic, and from then on a thread
  in its process writes every message it receives into that ring. Every reader of the node, the relay's own
  rank included, reads the ring as a shared-memory reader (the same zero-copy path as a local reader).
- Each relayed reader also holds a presence connection: it subscribes only to its rank's topic naming the node,
  so no message is ever sent on it; it tells the writer the rank is there (``wait_until_ready`` counts a relayed
  rank once its presence and its node's relay stream are both in) and, when it closes (the process died, the
  node was cut off: the same TCP timers, ``HOTLOOP_PEER_TIMEOUT_S``), that the rank left.
- A dead relay is a dead peer for every rank behind it: when the relay's stream goes (its process died or
  closed its reader, or the node stopped answering), the writer's ``enqueue`` raises DeadPeerError naming a rank
  of the node and the node (or drops them all, ``dead_reader="drop"``); the node's readers raise DeadPeerError
  once they have read every message the relay received (the relay's process died: the ring's writer is dead;
  the relay lost the writer: it abandons the ring). So does a relayed reader that dies while the node's ring is
  full behind it: the relay's write into the ring finds its cursor dead and raises DeadPeerError (with the
  queue's ``dead_reader="drop"``, the ring drops it instead), and the relay abandons the ring. The writer's
  shutdown reaches them as ClosedError.
- The ring's name is removed when the first message arrives (every reader of the node attached by then, since
  the writer waits for them) or when the relay closes; a relay killed before that leaves a name that
  ``reap_stale_segments()`` removes (its header names a dead writer). A relayed rank that left cannot attach
  again (its slot is closed); a direct reader (``node=""``) can.

Why the node's first reader and not a relay process of its own: nothing more to start, supervise or clean up
(a relay process outliving its readers, or dying alone, would need both), and the ranks of a node live and die
together in the engines this serves (a tensor-parallel worker lost ends the engine either way). The cost is that
the relay's rank carries the relay thread: one receive and one ring write per message, both in one C++ call with
the GIL released (``RemoteSubscriber.forward``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading

import zmq

from hotloop import _core
from hotloop._core import ClosedError, DeadPeerError, WaitPolicy
from hotloop.queue.remote.context import ProcessZmq
from hotloop.queue.remote.sockets import reader_socket
from hotloop.queue.remote.subscriber import RemoteSubscriber
from hotloop.queue.remote.wire import MAX_NODE_BYTES, node_topic, rank_topic

log = logging.getLogger("hotloop.queue.relay")

NODE_RING_BYTES = 1 << 24  # a node ring's size when the queue has no local ring to take it from
# The relay writes what it received without waiting longer than this for room in one go: a full ring (a reader
# of the node behind) blocks it, and with it ZeroMQ's receive buffer and so the writer's send (nothing is lost).
_WRITE_POLICY = WaitPolicy(spin_us=20, yield_us=0)


def node_id() -> str:
    """This process's node name for relays: ``$HOTLOOP_NODE_ID``, else the host's name and boot id (two containers
    of one host that share ``/dev/shm`` share a node; set ``HOTLOOP_NODE_ID`` where they do not)."""
    if env := os.environ.get("HOTLOOP_NODE_ID"):
        return env
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def check_node(node: str) -> None:
    if not isinstance(node, str) or len(node.encode()) > MAX_NODE_BYTES or "@" in node:
        raise ValueError(f"node {node!r}: a node id is a string of at most {MAX_NODE_BYTES} bytes without '@'")


def ring_name(queue_name: str, node: str) -> str:
    """The name every reader of `node` derives for the queue's node ring (its PID namespace first, so that the
    reaper judges only rings made in its own)."""
    digest = hashlib.sha256(f"{queue_name}\0{node}".encode()).hexdigest()[:32]
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"/hotloop-node-{ns}-{digest}"


class Presence:
    """A relayed reader's connection that only says the rank is there (see contract); receives nothing."""

    def __init__(self, address: str, rank: int, node: str, server_public: bytes, client_keys: tuple[bytes, bytes]):
        self._owner_pid = os.getpid()
        self._zmq = ProcessZmq.acquire()
        self._sock = None
        try:
            self._sock = reader_socket(self._zmq.ctx, server_public, client_keys)
            self._sock.setsockopt(zmq.SUBSCRIBE, rank_topic(rank, node))
            self._sock.connect(address)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._zmq is None:
            return
        if os.getpid() == self._owner_pid:
            if self._sock is not None:
                self._sock.close(linger=0)
            self._zmq.release()
        self._zmq = self._sock = None


class Relay:
    """The node's relay (see contract): a thread that writes what the node's stream brings into the node ring."""

    def __init__(self, ring: _core.ShmRing, final_name: str, stream: RemoteSubscriber, rank: int, node: str):
        self.ring, self.final_name, self.stream, self.rank, self.node = ring, final_name, stream, rank, node
        self.relayed = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"hotloop-relay-{ring.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ring, stream = self.ring, self.stream
        try:
            stream.wait_readable(None)  # the first message: every reader of the node is in
            self._seal()
            while True:
                # One call with the GIL released: the receive and the write of its frames into the ring (copied
                # once, into the ring).
                stream.forward(ring, _WRITE_POLICY)
                self.relayed += 1
        except ClosedError:
            if stream.closed:  # close(): this process is leaving; the node's other readers lose their relay
                ring.abandon()
            else:  # the writer shut down: every reader gets ClosedError after the rest
                ring.shutdown()
        except BaseException as e:  # the writer lost (DeadPeerError), or a reader of the node died
            self.error = e
            if not isinstance(e, DeadPeerError):
                log.error("relay of node %r (rank %d) stopped: %s", self.node, self.rank, e)
            ring.abandon()
        finally:
            self._unlink()
            stream.close()

    def _seal(self) -> None:
        """First message: every reader of the node is in (the writer waited for them), so slots of ranks on other
        nodes stop holding the ring back, and the names go."""
        self.ring.close_unattached()
        self._unlink()

    def _unlink(self) -> None:
        self.ring.unlink()
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/dev/shm" + self.final_name)

    def close(self) -> None:
        """Stop relaying (from any thread); the node's other readers then raise DeadPeerError."""
        self.stream.close()
        self.ring.cancel_waits()  # a write waiting for room ends too
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


def attach(handle, rank: int, node: str):
    """Reader `rank` of a queue through its node's relay, starting the relay when it is the node's first reader.
    Returns (the node ring's reader, the objects the reader closes with it: its relay if it runs it, its
    presence connection)."""
    check_node(node)
    n_remote = handle.n_reader - handle.n_local_reader
    capacity = handle.capacity or NODE_RING_BYTES
    slot = rank - handle.n_local_reader
    keys = handle.remote_client_keys[slot]
    final = ring_name(handle.name, node)
    relay = None
    _core.reap_stale_segments()
    ring = _core.ShmRing.create(capacity, n_remote, 0, handle.dead_reader)
    try:
        os.link("/dev/shm" + ring.name, "/dev/shm" + final)  # the first reader of the node publishes its ring
    except FileExistsError:
        ring.close()
        ring = None
    try:
        if ring is not None:
            stream = RemoteSubscriber(handle.remote_address, rank, handle.name, handle.remote_server_key, keys,
                                      topic=node_topic(node))
            relay = Relay(ring, final, stream, rank, node)
        reader = _core.ShmRing.attach(final, slot, capacity, n_remote)
    except BaseException:
        if relay is not None:
            relay.close()
        elif ring is not None:
            ring.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink("/dev/shm" + final)
        raise
    try:
        presence = Presence(handle.remote_address, rank, node, handle.remote_server_key, keys)
    except BaseException:
        reader.close()
        if relay is not None:
            relay.close()
        raise
    return reader, tuple(x for x in (presence, relay) if x is not None)
