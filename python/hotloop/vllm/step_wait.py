"""StepPacedWait: how a hotloop.vllm reader waits for vLLM's next step message.

Contract:

- The paced default (``reader_policy``): a shared-memory reader (a worker reading the step broadcast, the engine
  core reading a worker's answer) waits with ``WaitPolicy(paced=True)`` unless ``HOTLOOP_VLLM_PACED=0`` (read when
  the reader attaches) or the yield budget below is on (it replaces it). Steps come at a steady period (~1.4 ms a
  decode step on a GPU host): the policy learns it from the time between messages, sleeps on a timer until
  shortly before the next one is due and spins through it; an early message still wakes it (a normal park wake-up),
  an idle period only parks (wait_policy.h, "Paced mode"). Measured with ``python -m hotloop.bench.queue_bench
  --only periodic --full`` (a writer process sending 64 B every 1.4 ms +-10 %, 2-vCPU VM while other jobs ran;
  medians of 5 invocations of 3 alternating runs): p50 delivery 31.0 us (26.6-37.4) at 12.7 % of a spinning
  reader's CPU, against 34.8 us (32.0-54.8) for the plain wait at 3.7 % and 14.4 us (11.7-18.0) spinning; p99 289
  us against 801 and 567 (wait_policy.h says why a hit costs more than spinning on this VM). A network reader
  keeps its own policy (it parks at once).

- One object per reader queue (the thread that dequeues from it). ``read(read_fn, timeout)`` calls
  ``read_fn(timeout)`` (the queue's own timed dequeue) at most twice: first with a yield budget, under a policy
  that spins 20 us then calls ``sched_yield()`` until the budget ends (the process stays runnable, so the step
  that ends the wait does not pay a wake-up); then, if nothing came, with the rest of the timeout under the
  parking policy (spin 20 us, yield 10 us, park on the futex: ~0 CPU). No loop in Python; TimeoutError,
  ClosedError and DeadPeerError come from ``read_fn`` as they would without it.
- The budget is the cap (``cap_us``) while the waits' moving average (EMA, weight 1/8, samples capped at 4x the
  cap) is within it, and 0 (park at once) when it is above: long steps (a GPU step of tens of ms) and idle
  periods cost nothing more than a park. After an idle period the budget is spent once, then the average is
  above the cap until steps come again. The whole cap, not a multiple of the average: on a loaded machine the
  waits vary, and every one that outlasts the budget pays a park, a wake-up and a wait for a core (a 2x-average
  budget measured 351 tok/s at TP=1 batch 1 where the whole cap measured 952).
- Off unless ``HOTLOOP_VLLM_YIELD_US`` (read when the reader attaches) sets the cap in microseconds (0 or unset:
  park at once, hotloop's default wait). Yielding pays only with a core to spare: a reader that yields on a core
  a worker needs slows that worker (TP=2 on 2 cores: 3 processes, 2 cores).

Why the yield budget is off by default (measured with ``hotloop bench vllm``-style runs, vLLM 0.32 CPU, tiny Llama, TP=1 batch 1,
three 128-token bursts per engine, on a 2-vCPU VM that other jobs kept at load 6-12): a step takes ~1.1 ms, the
engine core waits ~1 ms for the worker's answer and the worker ~0.2 ms for the next step. In one run yielding
through waits up to 3 ms gave 950 tok/s against 790 on vLLM's spinning queue and 170 parking; in the next, 210-265
(bursts from 150 to 680) against 680 parking and 710 on vLLM's queue. At TP=2 yielding readers were slower than
parking ones (335-407 against 563 tok/s). Quiet (load 1-3): TP=1 batch 1 1073 tok/s yielding, 965 on vLLM's
queue, 922 parking; TP=2 batch 1 463 yielding, 650 vLLM, 571 parking. It helps only with a core to spare, and
the loaded runs disagree, so the default keeps the wait that costs no CPU.
"""

from __future__ import annotations

import os
import time

from hotloop._core import WaitPolicy

_SPIN_US = 20.0


def paced_enabled() -> bool:
    """Whether shared-memory readers wait with the paced policy: HOTLOOP_VLLM_PACED (default on; 0/false/no/off
    turns it off, 1/true/yes/on or unset keeps it)."""
    env = os.environ.get("HOTLOOP_VLLM_PACED", "").strip().lower()
    if env in ("", "1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"HOTLOOP_VLLM_PACED must be 0/false/no/off or 1/true/yes/on, got {env!r}")


def reader_policy() -> WaitPolicy | None:
    """The policy a shared-memory reader attaches with by default: paced (see the module docstring), or None
    (the queue's default) when HOTLOOP_VLLM_PACED=0 or the yield budget is on."""
    return WaitPolicy(paced=True) if paced_enabled() and cap_us() == 0 else None


def cap_us() -> float:
    """The yield budget cap (microseconds) from HOTLOOP_VLLM_YIELD_US; 0: park at once."""
    env = os.environ.get("HOTLOOP_VLLM_YIELD_US", "").strip()
    try:
        value = float(env or 0)
    except ValueError:
        raise ValueError(f"HOTLOOP_VLLM_YIELD_US must be a number of microseconds, got {env!r}") from None
    if not value >= 0:
        raise ValueError(f"HOTLOOP_VLLM_YIELD_US must be >= 0, got {env!r}")
    return value


class StepPacedWait:
    """The yield-then-park wait of one reader (see the module docstring)."""

    def __init__(self, park_policy: WaitPolicy | None = None):
        self.cap_s = cap_us() / 1e6  # read once: a bad HOTLOOP_VLLM_YIELD_US fails the attach, not a step
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
