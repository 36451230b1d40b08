"""The network side of hotloop.MessageQueue: the writer publishes each message over TCP to readers on other nodes.

Contract:

- ``RemotePublisher`` (writer) binds a ZeroMQ XPUB socket. Each remote reader subscribes to every message and to
  its own rank topic, so the writer learns which ranks are attached (``wait_all_attached``), sees a second reader of
  the same rank, and sees a reader leave (its connection closes; a vanished node is given up when nothing of it
  arrived for ``HOTLOOP_PEER_TIMEOUT_S``, default 3 s, by heartbeats both ends send: ``sockets.keepalive``):
  ``write`` then raises DeadPeerError naming it, or forgets it (``dead_reader="drop"``). Messages are never dropped:
  a reader takes in what arrives in its ZeroMQ I/O thread (not bounded: ``sockets.keepalive`` says why), and
  once ``hwm`` messages are queued for a reader whose process takes nothing in, ``write`` waits, up to its
  timeout. ``close`` waits until every live reader has acknowledged all it was sent (``writer_linger_s``).
- ``RemoteSubscriber`` (reader) has the reader surface of a shared-memory ring (``read``, ``read_view``,
  ``release``, ``readable``, ``wait_readable``, ``source``, ``close``), so MessageQueue drives both alike.
  Its wait sleeps in ``wait_any`` on one descriptor, the same for the reader's whole life (so a prepared
  ``Waiter`` can hold it): an epoll set of the data socket's and its connection monitor's descriptors plus an
  eventfd that stays signalled while a message is buffered in the reader (or the writer shut down or was lost).
  ZeroMQ's descriptors are edge-like (a message can be waiting with the descriptor quiet), so every operation
  leaves the reader either holding the next message (eventfd signalled) or with ZeroMQ drained and its
  descriptor re-armed; ``readable()`` does the same and never blocks. A reader woken by its wait receives at
  once and looks once for the message behind it before returning (the receive and one ZMQ_EVENTS read, each of
  which may be a poll() inside ZeroMQ); the look stays before the return, not deferred to the next operation
  behind a signalled eventfd: deferred, the writer's next send in the same thread measured slower (a 64 B round
  trip 79-80 us against 66-69 us, ``python -m hotloop.bench.remote_round_trip --hops``).
- The hot path is C++ (``_core.ZmqReader`` / ``ZmqWriter``, csrc/hotloop/zmq_reader.h, zmq_writer.h): a reader's
  wait, receive, look for the next message and copy into the buffer it returns, and a writer's framing and send,
  each one call with the GIL released. pyzmq makes the sockets (keys, ZAP, connect/bind, monitors) and reads the
  writer's subscriptions; the C++ side borrows their raw pointers (``zmq.Socket.underlying``) and calls the very
  libzmq pyzmq loaded (resolved at run time, csrc/hotloop/zmq_api.h): one libzmq per process, none linked into
  the wheel. A message read costs ~2.5 us of the reader's CPU and a 64 B send ~1.7 us, against ~6 us and ~2.5-4 us
  in Python over pyzmq (a burst of 500 sent, then read, in one process; medians of 20 bursts).
- Every connection is authenticated and encrypted with CurveZMQ (``docs/security.md``): the writer holds a
  server key pair and one client key pair per remote rank, all fresh per queue; the handle carries the server's
  public key and each rank's client pair, so only a process given the handle can connect. A ZAP handler admits
  exactly those client keys and tags each connection with its rank, so a subscription counts only for the rank
  whose key made it: an unknown peer can neither read, count as ready, stall ``write``, nor forge another rank's
  leave. Rejected handshakes are counted (``rejected_peers``) and logged. The publisher binds only the address
  it advertises unless told otherwise; a reader checks the server's key, so it never talks to an impostor.
- A message of one part (every message without out-of-band buffers) travels as one frame, the message itself;
  anything else as several frames ``[kind, *parts]``: kind ``M`` carries the parts of one message (joined by the
  reader into one buffer it owns), kind ``S`` (with an empty part) is the writer's shutdown. ``write`` looks at
  subscriptions and refused handshakes every ``PEER_CHECK_EVERY`` writes and whenever ``PEER_CHECK_INTERVAL``
  passed since the last look, so a reader's arrival, departure or second attach is seen within that much of the
  writer's own time (a look costs two system calls, more than sending a 64 B message). ZeroMQ sends from its own
  thread: a message is on its way when ``write`` returns, and one the writer's process is killed right after may
  not arrive. A lost connection (the writer's process died or the network failed) raises DeadPeerError in the
  reader once every message received before it has been read. A reader parks at once by default (``DEFAULT_POLICY``).

Modules, one job each:

- ``publisher.py``: ``RemotePublisher``, the writer's XPUB end and its view of who is attached (its sends:
  ``_core.ZmqWriter``).
- ``subscriber.py``: ``RemoteSubscriber``, a remote reader's SUB end behind one waitable descriptor (its hot path:
  ``_core.ZmqReader``).
- ``context.py``: ``ProcessZmq``, the process-wide ZeroMQ context and ZAP handler, remade in a forked child; ends
  still open at exit are closed there.
- ``curve.py``: fresh CurveZMQ keys per queue and ``ZapHandler``, which admits exactly a queue's client keys.
- ``wire.py``: what travels: frame kinds and the subscription topics that say which rank or node is attached.
- ``sockets.py``: socket settings both ends share: the peer timeout (ZMTP heartbeats, TCP keepalive), a
  reader's socket, connection monitors, this node's address.
"""

from hotloop.queue.remote.curve import new_keys
from hotloop.queue.remote.publisher import RemotePublisher
from hotloop.queue.remote.sockets import default_connect_ip, peer_timeout_s
from hotloop.queue.remote.subscriber import RemoteSubscriber

__all__ = ["RemotePublisher", "RemoteSubscriber", "default_connect_ip", "new_keys", "peer_timeout_s"]
