"""The soak's request loads: ``EngineLoad`` (an AsyncEngineClient, multiproc executor, model "tiny") and
``OrchestratorLoad`` (two LLM replicas streaming into a transform replica), each serving a stream of good and bad
requests.

Contract:

- ``_RequestLoad`` drives one request of the mix to its end and tallies the outcome (``RequestTally``): a good
  request must finish, or fail with the death error of a chaos kill; a bad one (``BAD_REQUESTS``) must be
  rejected with a clear error (``CLEAR_REJECTIONS``, at the client's edge or by the engine) or be served. A
  request with no output within HANG_S of its previous one is hung (closed, which aborts it).
- ``EngineLoad`` restarts its engine when it dies; the first EngineDeadError of an incarnation times the kill.
  ``OrchestratorLoad`` replaces a dead replica (``add_replica``); the first ReplicaDeadError naming a killed
  replica times that kill. A death no kill explains is counted.
- Both run on the soak's event loop; ``targets()`` offers their processes to ``Chaos``.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from dataclasses import dataclass, field

from hotloop.soak.chaos import Target
from hotloop.soak.findings import Findings, Kill
from hotloop.soak.own_processes import HANG_S, START_TIMEOUT_S, children_of, send_signal

_WORDS = ["alpha", "beta", "gamma", "delta", "soak", "chaos", "queue", "token", "ring", "engine"]


def _good_request(rng: random.Random) -> dict:
    prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(1, 8)))
    return {"prompt": prompt, "max_tokens": rng.randrange(4, 40), "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": rng.randrange(1 << 31)}


# name -> the generate() arguments of a bad request. Each must end with a clear error (or be served); none may
# hang, kill the engine or fail another request.
BAD_REQUESTS = {
    "temperature=nan": lambda: {"prompt": "nan", "max_tokens": 8, "temperature": float("nan")},
    "temperature=1e-310": lambda: {"prompt": "tiny", "max_tokens": 8, "temperature": 1e-310},
    "temperature=inf": lambda: {"prompt": "inf", "max_tokens": 8, "temperature": float("inf")},
    "temperature=-1": lambda: {"prompt": "neg", "max_tokens": 8, "temperature": -1.0},
    "temperature='hot'": lambda: {"prompt": "str", "max_tokens": 8, "temperature": "hot"},
    "token id 300 (vocabulary)": lambda: {"prompt": [1, 300, 2], "max_tokens": 8},
    "token id -3": lambda: {"prompt": [-3], "max_tokens": 8},
    "token id 'a'": lambda: {"prompt": ["a"], "max_tokens": 8},
    "empty prompt": lambda: {"prompt": [], "max_tokens": 8},
    "prompt None": lambda: {"prompt": None, "max_tokens": 8},
    "max_tokens=0": lambda: {"prompt": "zero", "max_tokens": 0},
    "max_tokens=10**9": lambda: {"prompt": "huge", "max_tokens": 10**9},
    "max_tokens='many'": lambda: {"prompt": "many", "max_tokens": "many"},
    "stop_token_ids=['x']": lambda: {"prompt": "stop", "max_tokens": 8, "stop_token_ids": ["x"]},
    "seed=2**64": lambda: {"prompt": "seed", "max_tokens": 8, "temperature": 1.0, "seed": 2**64},
}
CLEAR_REJECTIONS = (ValueError, TypeError, OverflowError)  # RequestError is a ValueError


@dataclass
class RequestTally:
    good_finished: int = 0
    good_failed_by_kill: int = 0  # EngineDeadError / ReplicaDeadError while a chaos kill explains it
    good_failed_unexpected: int = 0
    bad_rejected: dict = field(default_factory=dict)  # exception type -> count
    bad_served: int = 0
    bad_failed_by_kill: int = 0
    bad_unexpected: int = 0  # a bad request that ended in something other than a clear error or a normal finish
    hung: int = 0
    deaths_unexplained: int = 0
    restarts: int = 0

    def as_dict(self):
        return dict(self.__dict__)


class _Hung(Exception):
    pass


async def _drive(agen, hang_s: float) -> list:
    """Every output of one request; _Hung if any next output takes longer than hang_s (the request is then
    closed, which aborts it)."""
    outs = []
    try:
        while True:
            try:
                async with asyncio.timeout(hang_s):
                    out = await agen.__anext__()
            except StopAsyncIteration:
                return outs
            except TimeoutError:
                raise _Hung(f"no output within {hang_s:.0f} s after {len(outs)} output(s)") from None
            outs.append(out)
    finally:
        await agen.aclose()


class _RequestLoad:
    """What EngineLoad and OrchestratorLoad share: one request of the good/bad mix, driven to its end, and its
    outcome tallied. Subclasses set report, rng, bad_ratio, tally, area (the report's area and label) and
    _inflight_bad / _ids."""

    area = ""

    async def _request(self, start, death_error, explain_death, unexplained: str) -> bool:
        """Run one request (start(request_id, kwargs) -> its output stream); True if it finished."""
        bad = self.rng.random() < self.bad_ratio
        name = self.rng.choice(list(BAD_REQUESTS)) if bad else "good"
        kwargs = BAD_REQUESTS[name]() if bad else _good_request(self.rng)
        self._ids += 1
        key = self._ids
        if bad:
            self._inflight_bad[key] = name
        t = self.tally
        try:
            # a leftover entry in the orchestrator names the kind of request that left it
            outs = await _drive(start(f"soak-{key}-{name}", kwargs), HANG_S)
            if outs and outs[-1].finished:
                if bad:
                    t.bad_served += 1
                else:
                    t.good_finished += 1
                return True
            self._unexpected(bad, name, f"the stream ended without a finished output ({len(outs)} outputs)")
        except _Hung as e:
            t.hung += 1
            self.report.finding(self.area, f"{self.label}request {name!r} hung: {e}", zero=True)
        except death_error as e:
            if explain_death(e):
                if bad:
                    t.bad_failed_by_kill += 1
                else:
                    t.good_failed_by_kill += 1
            else:
                self._unexpected(bad, name, f"{unexplained}: {e}")
        except CLEAR_REJECTIONS as e:
            if bad:
                t.bad_rejected[type(e).__name__] = t.bad_rejected.get(type(e).__name__, 0) + 1
            else:
                self._unexpected(bad, name, f"a good request failed: {e!r}")
        except Exception as e:
            self._unexpected(bad, name, f"{e!r}")
        finally:
            self._inflight_bad.pop(key, None)
        return False

    @property
    def label(self) -> str:
        return ""

    def _unexpected(self, bad, name, what):
        if bad:
            self.tally.bad_unexpected += 1
        else:
            self.tally.good_failed_unexpected += 1
        self.report.finding(self.area, f"{self.label}request {name!r}: {what}", zero=True)


class EngineLoad(_RequestLoad):
    """An AsyncEngineClient (multiproc executor) serving `concurrency` request streams; restarted when it dies."""

    def __init__(self, name: str, report: Findings, rng: random.Random, concurrency: int = 3, bad_ratio: float = 0.2,
                 step_delay_s: float = 0.01):
        self.name, self.report, self.rng = name, report, rng
        self.concurrency, self.bad_ratio, self.step_delay_s = concurrency, bad_ratio, step_delay_s
        self.tally = RequestTally()
        self.client = None
        self._pending_kill: Kill | None = None
        self._death_explained = False
        self._inflight_bad: dict[int, str] = {}
        self._ids = 0

    area = "engine"

    @property
    def label(self) -> str:
        return f"{self.name}: "

    @property
    def ready(self) -> bool:
        return self.client is not None

    def targets(self) -> list[Target]:
        c = self.client
        if c is None or self._pending_kill is not None:
            return []
        out = [Target("engine", f"{self.name} engine", c.engine_pid, lambda: self._kill("engine", c, c.engine_pid))]
        for pid in sorted(children_of(c.engine_pid)):
            out.append(Target("engine worker", f"{self.name} worker", pid,
                              lambda pid=pid: self._kill("engine worker", c, pid)))
        return out

    def _kill(self, kind, client, pid) -> Kill | None:
        if client is not self.client or self._pending_kill is not None:
            return None
        if not send_signal(pid, signal.SIGKILL):
            return None  # gone already, or the pid is no longer ours
        self._pending_kill = Kill(kind, f"{self.name} {kind}", pid, time.monotonic())
        return self._pending_kill

    async def run(self, stop: asyncio.Event):
        from hotloop.engine.client import AsyncEngineClient

        first = True
        while not stop.is_set():
            try:
                client = await AsyncEngineClient.start("tiny", executor="multiproc", tp=1,
                                                       step_delay_s=self.step_delay_s, start_timeout=START_TIMEOUT_S)
            except Exception as e:
                self.report.finding("engine", f"{self.name}: the engine did not start: {e!r}", zero=True)
                self.report.count("engine start failures")
                await asyncio.sleep(1)
                continue
            if not first:
                self.tally.restarts += 1
            first = False
            dead = asyncio.Event()
            self.client = client
            users = [asyncio.create_task(self._user(client, stop, dead)) for _ in range(self.concurrency)]
            await asyncio.gather(*users)
            self.client = None
            self._pending_kill = None
            await client.shutdown()

    async def _user(self, client, stop, dead):
        while not stop.is_set() and not dead.is_set():
            await self._one(client, dead)
            await asyncio.sleep(0)  # a request rejected at once must not starve the event loop

    async def _one(self, client, dead) -> bool:
        from hotloop.engine.client import EngineDeadError

        return await self._request(lambda rid, kw: client.generate(**kw, request_id=rid), EngineDeadError,
                                   lambda e: self._on_death(e, dead), "failed when the engine died with no kill")

    def _on_death(self, e, dead: asyncio.Event) -> bool:
        """The first EngineDeadError of an incarnation times its kill; True if a chaos kill explains the death."""
        if dead.is_set():
            return self._death_explained
        dead.set()
        kill, self._pending_kill = self._pending_kill, None
        if kill is not None:
            kill.detected_s.append(time.monotonic() - kill.t)
        else:
            self.tally.deaths_unexplained += 1
            bad = sorted(set(self._inflight_bad.values()))
            self.report.finding("engine", f"{self.name}: the engine died with no kill: {e} (bad requests in flight: "
                                          f"{bad or 'none'})", zero=True)
        self._death_explained = kill is not None  # the other requests of this incarnation fail of the same death
        return self._death_explained


class OrchestratorLoad(_RequestLoad):
    """An Orchestrator (two LLM replicas streaming into one transform replica) under a stream of requests; a dead
    replica is replaced with add_replica."""

    STAGE_REPLICAS = (2, 1)
    area = "orchestrator"

    def __init__(self, report: Findings, rng: random.Random, concurrency: int = 4, bad_ratio: float = 0.2,
                 step_delay_s: float = 0.01):
        self.report, self.rng = report, rng
        self.concurrency, self.bad_ratio, self.step_delay_s = concurrency, bad_ratio, step_delay_s
        self.tally = RequestTally()
        self.orch = None
        self.evictions_explained: set[str] = set()
        self._kills: dict[str, Kill] = {}  # replica name -> the chaos kill of it
        self._seen_dead: set[str] = set()
        self._adding = [0, 0]
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()
        self._inflight_bad: dict[int, str] = {}
        self._ids = 0

    @property
    def ready(self) -> bool:
        return self.orch is not None

    def targets(self) -> list[Target]:
        if self.orch is None:
            return []
        out = []
        for st in self.orch.stages:
            for r in st.replicas:
                if r.alive and r.name not in self._kills:
                    out.append(Target("replica", f"replica {r.name}", r.pid,
                                      lambda r=r, si=st.index: self._kill(r, si)))
        return out

    def _kill(self, replica, stage_index) -> Kill | None:
        if not replica.alive or replica.name in self._kills:
            return None
        send_signal(replica.pid, signal.SIGKILL)
        k = self._kills[replica.name] = Kill("replica", f"replica {replica.name}", replica.pid, time.monotonic())
        self._heal()
        return k

    def _heal(self):
        """Start replacements for every stage below its replica count (a replica that died, killed or not)."""
        if self.orch is None or self._stopping:
            return
        for st in self.orch.stages:
            live = sum(1 for r in st.replicas if r.alive)
            for _ in range(self.STAGE_REPLICAS[st.index] - live - self._adding[st.index]):
                self._adding[st.index] += 1
                task = asyncio.create_task(self._add(st.index))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _add(self, stage_index):
        try:
            await self.orch.add_replica(stage_index)
            self.tally.restarts += 1
        except Exception as e:
            self.report.finding("orchestrator", f"add_replica({stage_index}) failed: {e!r}", zero=True)
            self.report.count("orchestrator start failures")
        finally:
            self._adding[stage_index] -= 1

    async def run(self, stop: asyncio.Event):
        from hotloop.orchestrator import Orchestrator, StageSpec

        self._stopping = False
        llm = {"model": "tiny", "step_delay_s": self.step_delay_s}
        self.orch = await Orchestrator.start([StageSpec("llm", replicas=2, options=llm, stream_chunk_tokens=4),
                                              StageSpec("transform")])
        users = [asyncio.create_task(self._user(stop)) for _ in range(self.concurrency)]
        healer = asyncio.create_task(self._heal_schedule())
        await asyncio.gather(*users)
        self._stopping = True
        healer.cancel()
        await asyncio.gather(healer, *self._tasks, return_exceptions=True)
        left = len(self.orch._requests)  # white-box: every request ended, so none may stay registered
        if left:
            self.report.count("orchestrator request entries left", left)
            kinds = sorted({rid.split("-", 2)[2] for rid in self.orch._requests if rid.startswith("soak-")})
            self.report.finding("orchestrator", f"{left} request entries stay in the orchestrator after their requests "
                                                f"ended, left by the requests {kinds}", zero=True)
        self.tally.evictions = self.orch.monitor.evictions
        extra = self.tally.evictions - len(self._kills)  # every kill evicts one replica; any other eviction is a death
        if extra > self.tally.deaths_unexplained:
            self.report.finding("orchestrator", f"{self.tally.evictions} evictions for {len(self._kills)} replica kills",
                                zero=True)
            self.tally.deaths_unexplained = extra
        orch, self.orch = self.orch, None
        await orch.shutdown()

    async def _heal_schedule(self):
        """A replica that died while no request was bound to it is evicted silently: replace it too."""
        while True:
            await asyncio.sleep(2)
            self._heal()

    async def _user(self, stop):
        while not stop.is_set():
            started = time.monotonic()
            await self._one()
            # A request that ends without suspending (no live replica while one restarts, a rejection) must not
            # starve the event loop, the healer included: pace those. Load pacing, not a data path.
            await asyncio.sleep(0 if time.monotonic() - started > 0.01 else 0.05)

    async def _one(self) -> bool:
        from hotloop.orchestrator import ReplicaDeadError

        def start(rid, kw):
            prompt, max_tokens = kw.pop("prompt"), kw.pop("max_tokens")
            return self.orch.generate(prompt, max_tokens, request_id=rid, **kw)

        return await self._request(start, ReplicaDeadError, lambda e: self._on_replica_error(str(e)),
                                   "failed on a replica no kill explains")

    def _on_replica_error(self, msg: str) -> bool:
        """Time the kill it reports (first error naming the replica); False if no kill explains it."""
        self._heal()
        m = re.search(r"replica ([\w.-]+?)(?: of stage|:| is not running| was shut down)", msg)
        if m is None:  # "stage N has no live replica": explained if a kill left the stage short
            return bool(self._kills)
        rname = m.group(1)
        kill = self._kills.get(rname)
        if kill is None:
            if rname not in self._seen_dead:
                self._seen_dead.add(rname)
                self.tally.deaths_unexplained += 1
                bad = sorted(set(self._inflight_bad.values()))
                self.report.finding("orchestrator", f"replica {rname} died with no kill: {msg} (bad requests in "
                                                    f"flight: {bad or 'none'})", zero=True)
            return False
        if not kill.detected_s:
            kill.detected_s.append(time.monotonic() - kill.t)
        return True
