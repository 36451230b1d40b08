"""StepPacedWait: how a hotloop.vllm reader waits for vLLM's next step message, and which wait a reader gets.

Contract:

- The default (``choose(local_workers)``, once per shared-memory reader, at its first read; a network reader keeps
  its own policy: it parks at once). Every switch overrides the rule: ``HOTLOOP_VLLM_YIELD_US`` (a number: the yield
  budget below with that cap, 0 none; beside it ``HOTLOOP_VLLM_PACED=1`` makes its park phase paced) first, then
  ``HOTLOOP_VLLM_PACED`` (0/1: the plain or the paced wait). With
  neither set:
  - **yield budget, cap 1000 us**, where the model computes on the host's cores (vLLM's CPU platform; not the
    simulated device, which models a GPU). There the engine core and the workers take turns on the cores (a step's
    compute, then the engine core's output processing and next schedule), and a reader that parks between steps
    pays a wake-up per step, on a VM a halted vCPU woken through the hypervisor with its caches gone cold: vLLM's
    spinning readers were 1.1-1.3x faster than hotloop's paced and plain waits at TP=1 batch 16. With the budget a
    worker yields through the engine core's turn (its waits are within the cap: it takes the next broadcast without
    a wake-up, and a runnable engine core on its core still runs first), while the engine core, whose waits are
    the compute (above the cap at batch 16 and at TP=2), parks at once and leaves the cores to the workers. Figures:
    ``python -m hotloop.bench.vllm.batch`` (docs/vllm.md, "On vLLM's CPU build").
  - **plain** where the model is off the host (GPU platforms, the simulated device) but the engine core and this
    host's workers outnumber the cores: a paced reader's spin window takes a core another process needs (the
    simulated device at TP=2 on 2 cores: decode 1.27x vLLM's plain against 0.99x paced; docs/vllm.md).
  - **plain** in a container with a CPU limit (the cgroup's CFS quota, ``hotloop.host_cpu``, counted as the host's
    cores where it is below the affinity's) that the front end, the engine core and this host's workers
    outnumber: every thread of the container spends the quota, and once it is spent the whole container stops
    until the next 100 ms period, so a spin window there delays every request (the front end counts here: it
    spends the same quota).
  - **yield budget, cap 1000 us, then the plain park**, where the model is off the host and the engine core and
    this host's workers fit its cores but the front end makes them one too many (TP=1 on two cores): a step's
    host work can then outlast its device time (every wake-up is on the step's path), and a reader that yields
    keeps its core where nothing else wants it and hands it over where the front end does, without a park and
    a wake-up. Its budget follows the waits (below): where the device's step is long (waits above the cap on
    average) it parks at once, the plain wait. Measured (``python -m hotloop.bench.vllm.regimes --regime
    host-bound,device-bound --quick --rounds 2 --tp-sizes 1 --arms vllm,hotloop,hotloop-yield``, 2-vCPU VM, TP=1,
    medians of 2 within-round ratios to vLLM's queue, this budget against the paced wait): host-bound (1300+2)
    decode tok/s 0.90 against 0.75, ITL p50 1.20 / 1.05 against 1.36 / 1.16 (arrivals / Poisson), single
    request 1.00 against 0.90; device-bound (6500+2) level in every figure, the reads' waiting CPU 0.02x vLLM's
    against 0.04-0.06x. At TP=2 (the engine core and two workers outnumber the cores) the plain wait stays: the
    budget measured decode 0.88x against the plain wait's 0.98x.
  - **paced** everywhere else (a core per process, the model off the host): see below.
  The choice and its reason are logged once per process (``vllm.hotloop``, INFO) and kept in ``chosen``.

- The paced wait (``WaitPolicy(paced=True)``): steps come at a steady period (~1.4 ms a
  decode step on a GPU host): the policy learns it from the time between messages, sleeps on a timer until
  shortly before the next one is due and spins through it; an early message still wakes it (a normal park wake-up),
  an idle period only parks (wait_policy.h, "Paced mode"). Measured with ``python -m hotloop.bench.queue_bench
  --only periodic --full`` (a writer process sending 64 B every 1.4 ms +-10 %, 2-vCPU VM while other jobs ran;
  medians of 5 invocations of 3 alternating runs): p50 delivery 31.0 us (26.6-37.4) at 12.7 % of a spinning
  reader's CPU, against 34.8 us (32.0-54.8) for the plain wait at 3.7 % and 14.4 us (11.7-18.0) spinning; p99 289
  us against 801 and 567 (wait_policy.h says why a hit costs more than spinning on this VM).

- Chained reads (``chained_reads.py``; ``HOTLOOP_VLLM_CHAINS=0`` turns them off): where the rule gives no yield
  budget, a read that follows a message whose follower has come within ``CHAIN_GAP_US`` on average (a step's
  ``execute_model`` broadcast, followed by its ``sample_tokens``) yields through the gap for up to
  ``CHAIN_YIELD_US`` before it parks. ``chain_stats()`` counts, per kind of the message before, the reads, those
  that parked and those chained, for every reader of the process.
- One object per reader queue (the thread that dequeues from it). ``read(read_fn, timeout)`` calls
  ``read_fn(timeout)`` (the queue's own timed dequeue) at most twice: first with a yield budget, under a policy
  that spins 20 us then calls ``sched_yield()`` until the budget ends (the process stays runnable, so the step
  that ends the wait does not pay a wake-up); then, if nothing came, with the rest of the timeout under the
  parking policy (the paced or the plain wait: spin 20 us, yield 10 us, park on the futex: ~0 CPU). No loop in
  Python; TimeoutError, ClosedError and DeadPeerError come from ``read_fn`` as they would without it.
- The budget is the cap (``cap_us``) while the waits' moving average (EMA, weight 1/8, samples capped at 4x the
  cap) is within it, and 0 (park at once) when it is above: long steps (a GPU step of tens of ms, a CPU step's
  compute) and idle periods cost nothing more than a park. After an idle period the budget is spent once, then
  the average is above the cap until steps come again. The whole cap, not a multiple of the average: on a loaded
  machine the waits vary, and every one that outlasts the budget pays a park, a wake-up and a wait for a core (a
  2x-average budget measured 351 tok/s at TP=1 batch 1 where the whole cap measured 952).

Earlier figures for a yield budget everywhere (vLLM 0.32 CPU, tiny Llama, TP=1 batch 1, a 3000 us cap, three
128-token bursts per engine on a 2-vCPU VM that other jobs kept at load 6-12): a step takes ~1.1 ms, the engine
core waits ~1 ms for the worker's answer and the worker ~0.2 ms for the next step. In one run yielding gave 950
tok/s against 790 on vLLM's spinning queue and 170 parking; in the next, 210-265 against 680 parking and 710 on
vLLM's queue: with a core per process (TP=1 here) it is not the default.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import weakref

from hotloop import host_cpu
from hotloop._core import WaitPolicy
from hotloop.vllm.chained_reads import ChainedReads, kind_of, merged

_SPIN_US = 20.0


# Where the rule picks the yield budget (the model on the host's cores): its cap. On the 2-vCPU VM (tiny Llama) the
# workers' waits between steps (the engine core's turn: output processing and the next schedule) are 0.3-1 ms;
# the engine core's (the step's compute) 2.5-7 ms at TP=2 and ~2.5 ms at TP=1 batch 16, above it: it parks.
HOST_COMPUTE_YIELD_US = 1000.0
# The host's cores as the rule counts them (the smaller of this process's affinity and its cgroup's CPU quota, a
# container's CPU limit), and the quota alone (None: none), read once when the plugin loads (vLLM's CPU workers
# narrow their own affinity later, when they bind their OpenMP threads).
HOST_QUOTA = host_cpu.cpu_quota()
HOST_CORES = host_cpu.usable_cores(quota=HOST_QUOTA)
_FLAG_ON, _FLAG_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class ReaderWait:
    """How a shared-memory reader waits: kind "paced", "plain" or "yield" (cap_us > 0), and why."""

    kind: str
    cap_us: float
    why: str
    park_paced: bool = False  # "yield": its park phase paced (HOTLOOP_VLLM_PACED=1 beside the budget), else plain

    def policy(self) -> WaitPolicy | None:
        """The reader's park policy (None: the queue's default, the plain wait)."""
        return WaitPolicy(paced=True) if self.kind == "paced" or self.park_paced else None


chosen: list[tuple[str, ReaderWait]] = []  # (queue name, its wait) for each reader attached in this process


def _switch_set(name: str) -> bool:
    """Whether switch `name` is given at all (an override of the rule), whatever its value."""
    return bool(os.environ.get(name, "").strip())


def _switch_on(name: str) -> bool:
    """Whether switch `name` is on: unset or 1/true/yes/on; 0/false/no/off: off; anything else raises."""
    env = os.environ.get(name, "").strip().lower()
    if env in ("",) + _FLAG_ON:
        return True
    if env in _FLAG_OFF:
        return False
    raise ValueError(f"{name} must be 0/false/no/off or 1/true/yes/on, got {env!r}")


def paced_enabled() -> bool:
    """Whether HOTLOOP_VLLM_PACED leaves the paced wait on (unset or 1/true/yes/on; 0/false/no/off turns it off).
    The engine-core loop's wait follows this switch alone."""
    return _switch_on("HOTLOOP_VLLM_PACED")


def cap_us() -> float | None:
    """The yield budget's cap (microseconds) from HOTLOOP_VLLM_YIELD_US; 0: none; None: unset."""
    env = os.environ.get("HOTLOOP_VLLM_YIELD_US", "").strip()
    if not env:
        return None
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"HOTLOOP_VLLM_YIELD_US must be a number of microseconds, got {env!r}") from None
    if not value >= 0:
        raise ValueError(f"HOTLOOP_VLLM_YIELD_US must be >= 0, got {env!r}")
    return value


def model_on_host() -> bool:
    """Whether the model computes on this host's cores: vLLM's CPU platform, unless the simulated device
    (HOTLOOP_VLLM_SIM_DEVICE, a GPU's timing) stands in for it."""
    from hotloop.vllm import env_flag

    if os.environ.get("HOTLOOP_VLLM_SIM_DEVICE", "").strip() and env_flag("HOTLOOP_VLLM_SIM_DEVICE") is not False:
        return False
    platforms = sys.modules.get("vllm.platforms")  # loaded in every vLLM process before its queues carry steps
    if platforms is None:  # no vLLM in this process (the queue used on its own): nothing computes on the host
        return False
    try:
        return bool(platforms.current_platform.is_cpu())
    except Exception:  # a platform vLLM could not resolve: not the CPU build's known case
        return False


def choose(local_workers: int, on_host: bool | None = None, cores: float | None = None,
           quota: float | None = None) -> ReaderWait:
    """The wait of a shared-memory reader in a deployment with `local_workers` workers on this host (the module
    docstring's rule; `on_host`, `cores` and `quota` default to model_on_host(), HOST_CORES and HOST_QUOTA).
    `cores` is what the process may use (host_cpu.usable_cores: its affinity's cores, or the quota where that is
    smaller); `quota` is the cgroup's CPU quota (None: none), which decides whether a spin spends the pod's
    quota."""
    cap = cap_us()  # first: a bad setting fails the attach, not a step later
    paced_set = _switch_set("HOTLOOP_VLLM_PACED")
    if cap:
        paced = paced_set and paced_enabled()
        return ReaderWait("yield", cap, f"HOTLOOP_VLLM_YIELD_US={cap:g}" + " HOTLOOP_VLLM_PACED=1" * paced, paced)
    if paced_set or cap == 0:
        paced = paced_enabled()
        why = f"HOTLOOP_VLLM_PACED={os.environ['HOTLOOP_VLLM_PACED'].strip()}" if paced_set else \
            "HOTLOOP_VLLM_YIELD_US=0"
        return ReaderWait("paced" if paced else "plain", 0.0, why)
    on_host = model_on_host() if on_host is None else on_host
    if cores is None:
        cores, quota = HOST_CORES, HOST_QUOTA if quota is None else quota
    limited = quota is not None and quota <= cores  # the quota, not the affinity, is what binds
    processes = 1 + max(1, local_workers)
    if on_host:
        return ReaderWait("yield", HOST_COMPUTE_YIELD_US, "the model computes on this host's cores (vLLM's CPU "
                          "platform): readers yield through the other side's turn, then park")
    if limited:
        # Under a quota every thread of the cgroup spends it, the front end's too (it serves the requests and
        # streams the tokens): it counts beside the engine core and the workers.
        processes += 1
        if processes > cores:
            return ReaderWait("plain", 0.0, f"a CPU quota of {quota:g} core(s) (the cgroup's cpu.max / "
                              f"cfs_quota_us), below the front end, the engine core and {processes - 2} "
                              "worker(s): a spin would spend the quota every process of the container needs")
        return ReaderWait("paced", 0.0, f"a CPU quota of {quota:g} core(s), a core of it per process ({processes}"
                          " with the front end), the model off the host's cores")
    if processes > cores:
        return ReaderWait("plain", 0.0, f"the engine core and {processes - 1} worker(s) outnumber this host's "
                          f"{cores:g} core(s)")
    if processes + 1 > cores:
        return ReaderWait("yield", HOST_COMPUTE_YIELD_US, f"the front end, the engine core and {processes - 1} "
                          f"worker(s) outnumber this host's {cores:g} core(s): readers yield through short waits "
                          "(a host-bound step), park at once through long ones (a device-bound step)")
    return ReaderWait("paced", 0.0, f"a core per process ({processes} processes, {cores:g} cores), the model off "
                      "the host's cores")


class StepPacedWait:
    """The yield-then-park wait of one reader (see the module docstring)."""

    def __init__(self, park_policy: WaitPolicy | None = None, cap: float | None = None, parks=None,
                 chains: bool | None = None):
        """cap: the yield budget's cap in microseconds (default HOTLOOP_VLLM_YIELD_US's, 0 when unset); parks: a
        function returning the reader's kernel sleeps so far (MessageQueue.parks), for the chain counters; chains:
        whether a read that follows the first message of a chain yields through the gap (default
        HOTLOOP_VLLM_CHAINS, on unless 0/false/no/off; chained_reads.py)."""
        cap = cap_us() if cap is None else cap  # read once: a bad HOTLOOP_VLLM_YIELD_US fails the attach
        self.cap_s = (cap or 0.0) / 1e6
        self.park_policy = park_policy if park_policy is not None else WaitPolicy()
        self.yield_policy = WaitPolicy(spin_us=_SPIN_US, yield_us=0.0)
        self.ema_s = -1.0  # no history yet: the first wait yields the whole cap
        self.yielded = 0  # waits that ended within the yield budget
        self.parked = 0  # waits that went on to park
        self.parks = parks or (lambda: 0)
        self.chains = chains_enabled() if chains is None else chains
        self.chain = ChainedReads()
        _readers.add(self)

    def budget_s(self, cap_s: float) -> float:
        return 0.0 if cap_s <= 0 or self.ema_s > cap_s else cap_s

    def _record(self, waited_s: float, cap_s: float) -> None:
        waited_s = min(waited_s, 4 * cap_s)
        self.ema_s = waited_s if self.ema_s < 0 else self.ema_s + (waited_s - self.ema_s) / 8

    def read(self, read_fn, set_policy, timeout: float | None):
        """read_fn(timeout) under the yield policy, then under the park policy; set_policy(policy) installs the
        policy the queue's next read uses. The yield budget is the cap's (see the module docstring) or, where that
        is 0, the chain's (chained_reads.py)."""
        cap_s = self.cap_s
        budget = self.budget_s(cap_s)
        chained = False
        if budget <= 0 and self.chains:
            budget = self.chain.budget_s()
            chained = budget > 0
        parks0 = self.parks()
        t0 = time.perf_counter()
        out = _NOTHING
        try:
            if budget > 0 and (timeout is None or timeout > budget):
                self.yield_policy.yield_us = budget * 1e6
                set_policy(self.yield_policy)
                try:
                    out = read_fn(budget)
                    self.yielded += 1
                    return out
                except TimeoutError:
                    pass
                finally:
                    set_policy(self.park_policy)
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.perf_counter() - t0))
            self.parked += 1
            out = read_fn(timeout)
            return out
        finally:
            waited = time.perf_counter() - t0
            self._record(waited, cap_s)
            if out is not _NOTHING:
                self.chain.record(kind_of(out), waited, self.parks() > parks0, chained)


_NOTHING = object()
_readers: weakref.WeakSet = weakref.WeakSet()  # every StepPacedWait of this process, for chain_stats()


def chains_enabled() -> bool:
    """Whether HOTLOOP_VLLM_CHAINS leaves chained reads on (unset or 1/true/yes/on; 0/false/no/off: off)."""
    return _switch_on("HOTLOOP_VLLM_CHAINS")


def chain_stats(_self=None) -> dict[str, dict]:
    """Every reader of this process: per kind of the message before a read, its reads, parks, chained reads and
    summed wait (chained_reads.py). Runs as a vLLM worker's collective_rpc or an engine core's utility call too."""
    return merged([r.chain.stats() for r in list(_readers)])
