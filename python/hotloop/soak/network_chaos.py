"""``hotloop soak --network``'s second chaos: network faults on the remote readers' nodes, no process harmed.

Contract:

- Fault kinds (``KINDS``), each on one remote reader rank's node (``SoakNodes``) of a live queue generation:
  - ``partition``: every packet in and out of the node dropped until the generation ends. Within the bound
    (``bound_s``: ``HOTLOOP_PEER_TIMEOUT_S`` plus ``BOUND_SLACK_S``), the writer's ``enqueue`` and that reader's
    ``dequeue`` must both raise DeadPeerError (the time from the cut to each is recorded); it ends the
    generation as a kill does, and the group heals the node before the next one.
  - ``short cut``: a partition healed after 0.3-1.0 s (inside TCP's retransmissions before the peer timeout):
    nothing may be raised, lost or duplicated.
  - ``2 % loss``: 2 % of the node's packets dropped at random for 3-8 s (nftables ``numgen random``).
  - ``delay 20 ms +- 5 ms``: the node's delay proxy switched on for 3-8 s (proxied ranks only; never where no rank
    is proxied, ``--no-delay-proxy``).
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
from typing import TYPE_CHECKING

from hotloop.soak.net_fault import DELAY, KINDS, LOSS, PARTITION, SHORT_CUT, NetFault
from hotloop.soak.own_processes import log, send_signal

if TYPE_CHECKING:
    from hotloop.soak.nodes import SoakNodes
    from hotloop.soak.queue_load import QueueGroup

LOSS_PERCENT = 2
BOUND_SLACK_S = 5.0  # the peer timeout plus this: a 2-core machine under the whole soak (tests allow the same)


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
        kinds = tuple(k for k in KINDS if k != DELAY or self.nodes.any_proxied)
        todo = list(kinds)
        rng.shuffle(todo)  # the first faults cover every kind
        while True:
            left = until - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(left, max(1.0, rng.expovariate(1 / self.mean_interval_s))))
            left = until - time.monotonic()
            if left <= 0:
                break
            kind = todo[0] if todo else rng.choice(kinds)
            if kind == PARTITION and left < self.bound_s + 5:
                if todo:
                    continue
                kind = rng.choice(kinds[1:])
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
