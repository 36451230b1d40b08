"""``hotloop soak --network``'s second chaos: network faults on the remote readers' nodes, no process harmed.

Contract:

- Fault kinds (``KINDS``), each on one remote reader rank's node (``SoakNodes``) of a live queue generation:
  - ``partition``: every packet in and out of the node dropped until the generation ends. Within the bound
    (``bound_s``: ``HOTLOOP_PEER_TIMEOUT_S`` plus ``BOUND_SLACK_S``), the writer's ``enqueue`` and that reader's
    ``dequeue`` must both raise DeadPeerError (the time from the cut to each is recorded); it ends the
    generation as a kill does, and the group heals the node before the next one.
  - ``short cut``: a partition healed after 0.3-1.0 s (inside the retransmission and keepalive bounds):
    nothing may be raised, lost or duplicated.
  - ``2 % loss``: 2 % of the node's packets dropped at random for 3-8 s (nftables ``numgen random``).
  - ``delay 20 ms +- 5 ms``: the node's delay proxy switched on for 3-8 s (proxied ranks only).
- ``NetworkChaos.run(until)`` runs on the soak's event loop next to ``Chaos``: every ~``mean_interval_s``
  (exponential, at least 1 s) one fault on one free rank (``QueueGroup.net_targets``: a live generation with no
  fault on it, and none healed on its node within ``bound_s``: two short cuts a second apart are one long cut to
  TCP, whose retransmission due between them falls into the second; process chaos leaves a group alone while a
  fault is on it). The first ``len(KINDS)`` faults cover
  every kind once, in a seeded order; a kind with no free rank is retried at the next turn. No partition starts
  within ``bound_s + 5`` s of the end, so every one can be seen. The ``nft`` calls run in a thread; the loop
  sleeps only between faults and for a fault's planned length.
- Every message of a faulted generation is checked as any other (``QueueGroup._account``); the group fills in
  each ``NetFault``'s lost / duplicated / out of order / hung counts and the descriptors its processes left open
  after closing their queues; the driver adds the segments and processes the generation left at the end.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hotloop.soak.own_processes import log, send_signal

if TYPE_CHECKING:
    from hotloop.soak.nodes import SoakNodes
    from hotloop.soak.queue_load import QueueGroup

PARTITION, SHORT_CUT, LOSS, DELAY = "partition", "short cut", "2 % loss", "delay 20 ms +- 5 ms"
KINDS = (PARTITION, SHORT_CUT, LOSS, DELAY)
LOSS_PERCENT = 2
BOUND_SLACK_S = 5.0  # the peer timeout plus this: a 2-core machine under the whole soak (tests allow the same)


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


class NetworkChaos:
    def __init__(self, rng: random.Random, groups: list[QueueGroup], nodes: SoakNodes, bound_s: float,
                 mean_interval_s: float = 8.0):
        if mean_interval_s <= 0:
            raise ValueError(f"the mean interval between network faults must be > 0 s, got {mean_interval_s!r}")
        self.rng, self.groups, self.nodes = rng, groups, nodes
        self.bound_s, self.mean_interval_s = bound_s, mean_interval_s
        self.faults: list[NetFault] = []
        self._tasks: set[asyncio.Task] = set()
        # (group, generation, rank) -> when its node may take the next fault: bound_s after the last one healed,
        # once TCP's retransmission backoff from it has settled (two short cuts a second apart add up to one
        # cut longer than the peer timeout: the retransmission due between them falls into the second)
        self._quiet_until: dict[tuple[int, int, int], float] = {}

    async def run(self, until: float):
        rng = self.rng
        todo = list(KINDS)
        rng.shuffle(todo)  # the first faults cover every kind
        while True:
            left = until - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(left, max(1.0, rng.expovariate(1 / self.mean_interval_s))))
            left = until - time.monotonic()
            if left <= 0:
                break
            kind = todo[0] if todo else rng.choice(KINDS)
            if kind == PARTITION and left < self.bound_s + 5:
                if todo:
                    continue
                kind = rng.choice(KINDS[1:])
            now = time.monotonic()
            free = [(g, gen, rank) for g in self.groups for gen, rank in g.net_targets()
                    if (kind != DELAY or self.nodes.proxied(g.wid, rank))
                    and self._quiet_until.get((g.wid, gen, rank), 0.0) <= now]
            if not free:
                continue  # retried at the next turn
            if todo:
                todo.pop(0)
            g, gen, rank = rng.choice(free)
            if kind == PARTITION:
                seconds = 0.0  # until its generation ends
            else:
                seconds = rng.uniform(0.3, 1.0) if kind == SHORT_CUT else rng.uniform(3.0, 8.0)
                seconds = min(seconds, max(0.3, left))
            task = asyncio.create_task(self._inject(g, gen, rank, kind, seconds))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _inject(self, g: QueueGroup, gen: int, rank: int, kind: str, seconds: float):
        nodes = self.nodes
        fault = g.begin_fault(gen, rank, kind, seconds)
        if fault is None:
            return  # the generation ended meanwhile
        self.faults.append(fault)
        log(f"network chaos: {fault.label}" + ("" if kind == PARTITION else f" for {seconds:.2f} s"))
        try:
            fault.t = time.monotonic()
            if kind in (PARTITION, SHORT_CUT):
                await asyncio.to_thread(nodes.cut, g.wid, rank)
            elif kind == LOSS:
                await asyncio.to_thread(nodes.lose, g.wid, rank, LOSS_PERCENT)
            else:
                proxy = g.proxy_pid(gen, rank)
                if proxy is None or not send_signal(proxy, signal.SIGUSR1):
                    fault.note = "the delay proxy was gone"
                    g.end_fault(fault)
                    return
        except Exception as e:  # the soak's own failure (nft): report it, end the fault
            fault.errors.append(f"injecting it failed: {e!r}")
            if kind != PARTITION:
                g.end_fault(fault)
            return
        if kind == PARTITION:
            return  # the group heals the node once the generation ended
        try:
            await asyncio.sleep(seconds)  # the fault's planned length
        finally:
            try:
                if kind == DELAY:
                    proxy = g.proxy_pid(gen, rank)
                    if proxy is not None:
                        send_signal(proxy, signal.SIGUSR2)
                else:
                    await asyncio.to_thread(nodes.heal, g.wid, rank)
            except Exception as e:
                fault.errors.append(f"healing it failed: {e!r}")
            fault.lasted_s = time.monotonic() - fault.t
            self._quiet_until[(g.wid, gen, rank)] = time.monotonic() + self.bound_s
            g.end_fault(fault)
