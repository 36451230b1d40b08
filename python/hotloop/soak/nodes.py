"""Where ``hotloop soak --network`` runs each queue process: simulated nodes (hotloop.testing.netns.Nodes).

Contract:

- ``SoakNodes(groups)`` makes one node for the queue writers and their shared-memory readers ("writers", the hub
  of the star of veth links) and one node per remote reader rank of each group (``q<wid>r<rank>``), so every
  remote reader's traffic crosses a link of its own that a fault can cut, thin or slow down.
- ``writer_ns`` / ``reader_ns(wid, rank)`` name the namespace file a spawned process joins first
  (``netns.join``); ``connect_ip`` is the address the writers advertise (they bind exactly it).
- ``proxied(wid, rank)``: this rank reads through a ``hotloop.testing.delay_proxy`` on its own node (started
  switched off; the delay fault switches it on), so a delay fault has a path to slow down while a partition of
  that node still cuts both the writer's connection and the reader's. The last remote rank of each group is
  proxied, the others connect straight to the writer; ``SoakNodes(groups, delay_proxy=False)``: none is.
- ``cut`` / ``lose`` / ``heal`` act on a reader rank's node (each runs ``nft`` in the node: a few ms, blocking);
  ``lose_steadily`` puts a loss on every reader node that stays under the other faults until the nodes go;
  ``close()`` removes every node, whatever state its links are in.
"""

from __future__ import annotations

from hotloop.testing.netns import Nodes

WRITERS = "writers"


def reader_node(wid: int, rank: int) -> str:
    return f"q{wid}r{rank}"


class SoakNodes:
    def __init__(self, groups: list[tuple[int, int, int]], delay_proxy: bool = True):
        """groups: (writer id, readers, shared-memory readers) of each queue group."""
        self.remote = [(wid, rank) for wid, n_reader, n_local in groups for rank in range(n_local, n_reader)]
        self._proxied = {(wid, n_reader - 1) for wid, n_reader, n_local in groups
                         if n_reader > n_local and delay_proxy}
        self.nodes = Nodes([WRITERS, *(reader_node(w, r) for w, r in self.remote)])

    @property
    def connect_ip(self) -> str:
        return self.nodes.addr[WRITERS]

    @property
    def writer_ns(self) -> str:
        return self.nodes.path(WRITERS)

    def reader_ns(self, wid: int, rank: int) -> str:
        """A remote rank's node; a shared-memory reader shares the writer's."""
        return self.nodes.path(reader_node(wid, rank) if (wid, rank) in self.remote else WRITERS)

    def proxied(self, wid: int, rank: int) -> bool:
        return (wid, rank) in self._proxied

    @property
    def any_proxied(self) -> bool:
        return bool(self._proxied)

    def cut(self, wid: int, rank: int) -> None:
        self.nodes.cut(reader_node(wid, rank))

    def lose(self, wid: int, rank: int, percent: int) -> None:
        self.nodes.lose(reader_node(wid, rank), percent)

    def lose_steadily(self, percent: int) -> None:
        """``percent`` % of every remote reader node's packets dropped each way from now on, under every other fault
        (``hotloop soak --network --sustained-loss``)."""
        for wid, rank in self.remote:
            self.nodes.lose(reader_node(wid, rank), percent, steady=True)

    def heal(self, wid: int, rank: int) -> None:
        self.nodes.heal(reader_node(wid, rank))

    def close(self) -> None:
        self.nodes.close()
