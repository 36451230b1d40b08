"""A network fault of ``hotloop soak --network`` as a record: its kind and what the queue made of it.

Contract:

- ``KINDS``: the fault kinds (``PARTITION``, ``SHORT_CUT``, ``LOSS``, ``DELAY``); ``network_chaos`` says what each
  does to a node.
- ``NetFault``: one fault on one reader rank's node. ``NetworkChaos`` creates it through the queue group
  (``QueueGroup.begin_fault``), the group fills in what its generation saw, the report reads it.
- Plain data: it imports no other part of the soak, so the queue load and the network chaos can both import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARTITION, SHORT_CUT, LOSS, DELAY = "partition", "short cut", "2 % loss", "delay 20 ms +- 5 ms"
KINDS = (PARTITION, SHORT_CUT, LOSS, DELAY)


@dataclass
class NetFault:
    """One network fault on one reader rank's node, and what the queue made of it."""

    kind: str
    wid: int
    gen: int
    rank: int
    t: float  # monotonic, when the fault began (one clock for every namespace)
    seconds: float = 0.0  # planned length (a partition lasts until its generation ends)
    lasted_s: float = 0.0  # from the start of injecting it to the end of healing it: at most this long (a loaded
    #                        machine runs nft late; TCP rides out a cut of up to ~1.4 s, see report.py)
    detected_s: dict = field(default_factory=dict)  # "writer" / "reader" -> seconds from the fault to DeadPeerError
    errors: list = field(default_factory=list)  # anything raised that the fault should not have caused
    lost: int = 0
    dup: int = 0
    ooo: int = 0
    hung: int = 0
    fds_left: int = 0  # descriptors the writer's and this reader's queues left open after close()
    fds_reported: int = 0  # how many of those two processes reported them (a killed one cannot)
    pids: set = field(default_factory=set)  # the generation's processes (leaks are counted against them)
    leaked_segments: int = 0
    leaked_processes: int = 0
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.kind} on q{self.wid}.g{self.gen} reader r{self.rank}'s node"
