"""hotloop's message queue: one writer, many readers, across processes and nodes.

- ``message_queue.py``: ``MessageQueue`` and its ``Handle``, the facade engine code uses (vLLM's names);
- ``backends.py``: the reader and writer surfaces a queue drives (a shared-memory ring, the network);
- ``remote/``: the network side (CurveZMQ over TCP): the writer's publisher, a remote reader's subscriber, the
  process's ZeroMQ context, keys and ZAP handler, topics and socket settings, a module each;
- ``relay.py``: a node's relay, which gives the readers that share a node one stream from the writer;
- ``serialization.py``: how objects become messages (pickle 5 with out-of-band buffers) and back.

The shared-memory ring itself is C++ (``hotloop._core.ShmRing``).
"""

from hotloop.queue.message_queue import Handle, MessageQueue

__all__ = ["Handle", "MessageQueue"]
