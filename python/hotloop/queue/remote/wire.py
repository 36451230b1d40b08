"""What a remote queue's connections carry, besides the messages' own bytes.

- Message frames: a message of one part travels as one frame, the message itself; anything else as several frames
  ``[kind, *parts]``: ``KIND_MESSAGE`` carries the parts of one message, ``KIND_SHUTDOWN`` (with an empty part) is
  the writer's shutdown.
- Subscription topics: a reader tells the writer who it is by what it subscribes to (its rank's topic, with its
  node's name behind a relay; a relay subscribes to its node's topic). Pure functions and constants; no I/O.
"""

from __future__ import annotations

KIND_MESSAGE = b"M"
KIND_SHUTDOWN = b"S"

# Subscription topics. Each starts with \x01, never the first byte of a message frame, so it matches none: a
# subscription to one only tells the writer who is there. A direct reader's data connection subscribes to
# everything and to its rank's topic; on a node with a relay, each reader's presence connection subscribes to its
# rank's topic naming the node, and the relay's data connection to everything and to the node's topic.
RANK_TOPIC = b"\x01hotloop-rank-"
NODE_TOPIC = b"\x01hotloop-node-"
MAX_NODE_BYTES = 200


def rank_topic(rank: int, node: str | None = None) -> bytes:
    return RANK_TOPIC + b"%d" % rank + (b"" if node is None else b"@" + node.encode())


def node_topic(node: str) -> bytes:
    return NODE_TOPIC + node.encode()


def parse_rank_topic(topic: bytes, topics: dict[bytes, int]) -> tuple[int | None, str | None]:
    """(rank, node) of a rank topic (node None for a direct reader's); (None, None) for anything else."""
    rank = topics.get(topic)
    if rank is not None:
        return rank, None
    head, sep, node = topic.partition(b"@")
    rank = topics.get(head)
    if rank is None or not sep or not node or len(node) > MAX_NODE_BYTES:
        return None, None
    return rank, node.decode(errors="replace")
