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

from hotloop._core import WaitPolicy

_SPIN_US = 20.0


# Where the rule picks the yield budget (the model on the host's cores): its cap. On the 2-vCPU VM (tiny Llama) the
# workers' waits between steps (the engine core's turn: output processing and the next schedule) are 0.3-1 ms;
# the engine core's (the step's compute) 2.5-7 ms at TP=2 and ~2.5 ms at TP=1 batch 16, above it: it parks.
HOST_COMPUTE_YIELD_US = 1000.0
# The cores this process may run on, read once when the plugin loads it (vLLM's CPU workers narrow their own
# affinity later, when they bind their OpenMP threads).
HOST_CORES = len(os.sched_getaffinity(0))
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


def paced_enabled() -> bool:
    """Whether HOTLOOP_VLLM_PACED leaves the paced wait on (unset or 1/true/yes/on; 0/false/no/off turns it off).
    The engine-core loop's wait follows this switch alone."""
    env = os.environ.get("HOTLOOP_VLLM_PACED", "").strip().lower()
    if env in ("",) + _FLAG_ON:
        return True
    if env in _FLAG_OFF:
        return False
    raise ValueError(f"HOTLOOP_VLLM_PACED must be 0/false/no/off or 1/true/yes/on, got {env!r}")


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


def choose(local_workers: int, on_host: bool | None = None, cores: int | None = None) -> ReaderWait:
    """The wait of a shared-memory reader in a deployment with `local_workers` workers on this host (the module
    docstring's rule; `on_host` and `cores` default to model_on_host() and HOST_CORES)."""
    cap = cap_us()  # first: a bad setting fails the attach, not a step later
    paced_env = os.environ.get("HOTLOOP_VLLM_PACED", "").strip()
    if cap:
        paced = bool(paced_env) and paced_enabled()
        return ReaderWait("yield", cap, f"HOTLOOP_VLLM_YIELD_US={cap:g}" + " HOTLOOP_VLLM_PACED=1" * paced, paced)
    if paced_env or cap == 0:
        paced = paced_enabled()
        why = f"HOTLOOP_VLLM_PACED={paced_env}" if paced_env else "HOTLOOP_VLLM_YIELD_US=0"
        return ReaderWait("paced" if paced else "plain", 0.0, why)
    on_host = model_on_host() if on_host is None else on_host
    cores = HOST_CORES if cores is None else cores
    processes = 1 + max(1, local_workers)
    if on_host:
        return ReaderWait("yield", HOST_COMPUTE_YIELD_US, "the model computes on this host's cores (vLLM's CPU "
                          "platform): readers yield through the other side's turn, then park")
    if processes > cores:
        return ReaderWait("plain", 0.0, f"the engine core and {processes - 1} worker(s) outnumber this host's "
                          f"{cores} core(s)")
    return ReaderWait("paced", 0.0, f"a core per process ({processes} processes, {cores} cores), the model off "
                      "the host's cores")


class StepPacedWait:
    """The yield-then-park wait of one reader (see the module docstring)."""

    def __init__(self, park_policy: WaitPolicy | None = None, cap: float | None = None):
        """cap: the yield budget's cap in microseconds (default HOTLOOP_VLLM_YIELD_US's, 0 when unset)."""
        cap = cap_us() if cap is None else cap  # read once: a bad HOTLOOP_VLLM_YIELD_US fails the attach
        self.cap_s = (cap or 0.0) / 1e6
        self.park_policy = park_policy if park_policy is not None else WaitPolicy()
        self.yield_policy = WaitPolicy(spin_us=_SPIN_US, yield_us=0.0)
        self.ema_s = -1.0  # no history yet: the first wait yields the whole cap
        self.yielded = 0  # waits that ended within the yield budget
        self.parked = 0  # waits that went on to park

    def budget_s(self, cap_s: float) -> float:
        return 0.0 if cap_s <= 0 or self.ema_s > cap_s else cap_s

    def _record(self, waited_s: float, cap_s: float) -> None:
        waited_s = min(waited_s, 4 * cap_s)
        self.ema_s = waited_s if self.ema_s < 0 else self.ema_s + (waited_s - self.ema_s) / 8

    def read(self, read_fn, set_policy, timeout: float | None):
        """read_fn(timeout) under the yield policy, then under the park policy; set_policy(policy) installs the
        policy the queue's next read uses."""
        cap_s = self.cap_s
        budget = self.budget_s(cap_s)
        t0 = time.perf_counter()
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
            return read_fn(timeout)
        finally:
            self._record(time.perf_counter() - t0, cap_s)
