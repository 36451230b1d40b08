"""The soak's driver: ``Soak`` starts every load and the chaos, runs them for the given minutes, stops them and
waits for every outcome; ``run`` wraps it with the leak check and prints the table.

Contract:

- ``run`` takes a baseline of /dev/shm/hotloop-* entries, children, descriptors and threads, runs ``Soak`` on an
  asyncio loop, waits up to 10 s for processes and segments to go, and counts what is left (segments by their
  creator, so other programs' are reported apart). Children's stdout goes to stderr: the table alone is on
  stdout. Returns the exit code: 0 when every must-be-0 row is 0 and the goal holds (or is not failed on).
- ``Soak.run`` waits at most START_TIMEOUT_S for the loads to start, runs the chaos until the end, then stops the
  loads and gives them 2 x HANG_S + 30 s to report every outcome. The driver sleeps only between its own steps
  (start-up, progress lines, the process tracker): never on a data path.
- ``network=True`` (``hotloop soak --network``): the queue groups run on simulated nodes (``SoakNodes``), and
  ``NetworkChaos`` injects network faults on the remote readers' nodes next to ``Chaos``; the nodes are removed
  before the leak check, and each fault is charged the segments and processes its generation left.
  ``sustained_loss`` (``--sustained-loss PCT``): every remote reader node drops that share of its packets each way
  for the whole run, under the other faults: a live connection must not be lost to it (a DeadPeerError that no
  kill or partition explains is an unexpected error), and partitions must still be seen within the bound.
  ``delay_proxy=False`` (``--no-delay-proxy``): every remote reader connects straight to its writer, and no delay
  fault is injected (to tell what the user-space proxy adds from what the link does).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

from hotloop.soak.chaos import Chaos
from hotloop.soak.network_chaos import BOUND_SLACK_S, NetworkChaos
from hotloop.soak.own_processes import (HANG_S, LOOPBACK, START_TIMEOUT_S, creator_pid, log, children_of,
                                        descendants_of, open_fds, shm_entries)
from hotloop.soak.queue_load import QueueGroup
from hotloop.soak.report import Report
from hotloop.soak.request_load import EngineLoad, OrchestratorLoad

QUEUE_GROUPS = ((0, 3, 2), (1, 3, 1))  # (writer id, readers, shared-memory readers)


class Soak:
    def __init__(self, minutes: float, seed: int, report: Report, workdir: str, network: bool = False,
                 network_interval_s: float = 8.0, sustained_loss: int = 0, delay_proxy: bool = True):
        self.minutes, self.seed, self.report = minutes, seed, report
        rng = random.Random(seed)
        self.nodes = self.net_chaos = None
        if network:
            from hotloop.queue.remote import peer_timeout_s
            from hotloop.soak.nodes import SoakNodes

            self.bound_s = peer_timeout_s() + BOUND_SLACK_S
            self.nodes = SoakNodes(list(QUEUE_GROUPS), delay_proxy)
            if sustained_loss:
                try:
                    self.nodes.lose_steadily(sustained_loss)
                except BaseException:
                    self.nodes.close()
                    raise
        self.groups = [QueueGroup(wid, n, n_local, report, seed, workdir, nodes=self.nodes)
                       for wid, n, n_local in QUEUE_GROUPS]
        self.engine = EngineLoad("e0", report, random.Random(rng.random()))
        self.orch = OrchestratorLoad(report, random.Random(rng.random()))
        self.chaos = Chaos(random.Random(rng.random()), [*self.groups, self.engine, self.orch], report)
        if network:
            self.net_chaos = NetworkChaos(random.Random(rng.random()), self.groups, self.nodes, self.bound_s,
                                          network_interval_s)
        self.pids: set[int] = {os.getpid()}

    def close(self):
        """Removes the simulated nodes (after the loads stopped)."""
        if self.nodes is not None:
            self.nodes.close()

    async def run(self):
        stop = asyncio.Event()
        tracker = asyncio.create_task(self.track_processes())
        for g in self.groups:
            g.start()
        loads = [asyncio.create_task(self.engine.run(stop), name="soak-engine"),
                 asyncio.create_task(self.orch.run(stop), name="soak-orchestrator")]
        log("starting: 2 queue groups" + ("" if self.nodes is None else f" on {len(self.nodes.remote) + 1} simulated "
                                                                          "nodes") +
             ", 1 engine, 1 orchestrator (2 LLM replicas + 1 transform)")
        t0 = time.monotonic()
        while not (all(g.ready for g in self.groups) and self.engine.ready and self.orch.ready):
            if time.monotonic() - t0 > START_TIMEOUT_S or any(t.done() for t in loads):
                break
            await asyncio.sleep(0.2)  # start-up only
        log(f"running {self.minutes:g} min with chaos (started in {time.monotonic() - t0:.1f} s)")
        until = time.monotonic() + self.minutes * 60
        progress = asyncio.create_task(self._progress(until))
        await asyncio.gather(self.chaos.run(until), *([] if self.net_chaos is None else [self.net_chaos.run(until)]))
        progress.cancel()
        await asyncio.gather(progress, return_exceptions=True)
        log("chaos over: stopping the load; every outcome must arrive")
        stop.set()
        for g in self.groups:
            g.stop()
        done, pending = await asyncio.wait(loads, timeout=2 * HANG_S + 30)
        for t in pending:
            self.report.count(f"{t.get_name().removeprefix('soak-')} did not stop")
            self.report.finding("soak", f"{t.get_name()} did not stop within {2 * HANG_S + 30:.0f} s", zero=True)
            t.cancel()
        for t in done:
            if t.exception() is not None:
                self.report.finding("soak", f"{t.get_name()} failed: {t.exception()!r}", zero=True)
        for g in self.groups:
            if not await asyncio.to_thread(g.join, HANG_S + 10):
                self.report.count("queue processes hung")
                self.report.finding("queue", f"q{g.wid}: the group did not stop", zero=True)
        tracker.cancel()
        await asyncio.gather(tracker, return_exceptions=True)
        for g in self.groups:
            self.pids |= g.pids

    async def track_processes(self):
        """Every process of this soak's tree, sampled twice a second: tells its /dev/shm segments from those of
        other programs running on the machine (a monitor, not a data path)."""
        me = os.getpid()
        while True:
            self.pids |= descendants_of(me)
            await asyncio.sleep(0.5)

    async def _progress(self, until):
        while True:
            await asyncio.sleep(10)
            e, o = self.engine.tally, self.orch.tally
            log(f"{max(0.0, until - time.monotonic()):.0f} s left: queue sent {sum(g.sent for g in self.groups)} "
                 f"in {sum(g.generations for g in self.groups)} generations; engine {e.good_finished} ok, "
                 f"{sum(e.bad_rejected.values())} rejected; orchestrator {o.good_finished} ok; "
                 f"kills {len(self.report.kills)}; "
                 + ("" if self.net_chaos is None else f"network faults {len(self.net_chaos.faults)}; ")
                 + f"findings {len(self.report.findings)}")


def _collect_leaks(soak: Soak, me: int, shm0: set, kids0: set, fds0: set, threads0: set) -> dict:
    """At the end of the run: what the soak left behind beyond the baselines taken before it (waiting up to 10 s
    for processes and segments to go away), each network fault's share of it; kills the children left."""
    deadline = time.monotonic() + 10
    while True:  # end of run: processes exit and segments go away asynchronously
        gc.collect()
        kids = children_of(me) - kids0
        shm = shm_entries() - shm0
        fds = open_fds() - fds0
        threads = [t for t in threading.enumerate() if t not in threads0 and t.is_alive()]
        if not (kids or shm or fds or threads) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    fd_names = {}
    for fd in fds:
        try:
            fd_names[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    ours = {x for x in shm if creator_pid(x) in soak.pids}
    leaks = {"shm": sorted(ours), "shm_of_other_programs": sorted(shm - ours), "children": sorted(kids), "fds": fd_names,
             "threads": [t.name for t in threads]}
    for fault in [] if soak.net_chaos is None else soak.net_chaos.faults:
        fault.leaked_segments = sum(1 for x in ours if creator_pid(x) in fault.pids)
        fault.leaked_processes = len(kids & fault.pids)
    for pid in kids:  # report them, then do not leave them behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return leaks


def run(minutes: float = 1.0, seed: int = 0, json_path: str | None = None, goal_s: float = 1.0,
        fail_on_goal: bool = True, network: bool = False, network_interval_s: float = 8.0,
        sustained_loss: int = 0, delay_proxy: bool = True) -> int:
    """Run the soak; print the table on stdout; return the exit code (0: every must-be-0 row is 0 and the goal).
    network: the queues on simulated nodes under network faults too (needs root, iproute2 and nftables:
    ``hotloop.testing.netns.Nodes.unavailable()`` says what is missing); sustained_loss: with network, the % of
    every remote reader node's packets dropped each way for the whole run; delay_proxy: with network, the last
    remote rank of each group reads through a delay proxy (False: every rank connects straight, no delay faults)."""
    if network:
        from hotloop.testing.netns import Nodes

        why = Nodes.unavailable()
        if why:
            raise RuntimeError(f"hotloop soak --network: {why}")
    if network_interval_s <= 0:
        raise ValueError(f"network_interval_s must be > 0, got {network_interval_s!r}")
    if not 0 <= sustained_loss < 100 or (sustained_loss and not network):
        raise ValueError(f"sustained_loss must be a % in [0, 100) and needs network=True, got {sustained_loss!r}")
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # kept for the whole process: not a leak
    import hotloop.engine.client  # noqa: F401  (imports done before the descriptor baseline)
    import hotloop.orchestrator  # noqa: F401
    import zmq  # noqa: F401

    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)  # children inherit stdout: their prints go to stderr, the table alone to stdout
    workdir = tempfile.mkdtemp(prefix="hotloop-soak-")
    me = os.getpid()
    shm0, kids0, fds0, threads0 = shm_entries(), children_of(me), open_fds(), set(threading.enumerate())
    report = Report()
    soak = Soak(minutes, seed, report, workdir, network, network_interval_s, sustained_loss, delay_proxy)
    try:
        asyncio.run(soak.run())
    finally:
        soak.close()
        leaks = _collect_leaks(soak, me, shm0, kids0, fds0, threads0)
        shutil.rmtree(workdir, ignore_errors=True)
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    cfg = {"minutes": minutes, "seed": seed, "hang_s": HANG_S, "loopback": LOOPBACK, "cpus": os.cpu_count()}
    net = None
    if network:
        cfg.update(network=True, network_interval_s=network_interval_s, network_bound_s=soak.bound_s,
                   sustained_loss_percent=sustained_loss, delay_proxy=delay_proxy)
        net = {"faults": soak.net_chaos.faults, "bound_s": soak.bound_s}
    rec = report.build(cfg, soak.groups, soak.engine, soak.orch, soak.chaos, leaks, goal_s, fail_on_goal, net)
    print(Report.render(rec), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rec, f, indent=2, default=str)
        log(f"wrote {json_path}")
    return 0 if rec["ok"] else 1
