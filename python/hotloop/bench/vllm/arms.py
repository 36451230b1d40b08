"""The arms of the vLLM benchmarks and what they run: each arm's environment, the load shapes, the checks that an
engine runs the arm it was started as, and what compares the arms' results.

- Arms: "vllm" (vLLM's queue and loop), "vllm+spinloop" (the same with vLLM's spinloop extension, on the simulated
  device), "hotloop" (hotloop's queue under vLLM's loop), "hotloop+loop" (hotloop's queue and engine-core loop,
  ``hotloop.vllm.engine_loop``), and with ``-plain`` the last two with their readers' plain wait. ``arm_env(tp,
  arm, device)`` is the environment of an engine of that arm (``HOTLOOP_VLLM``, ``HOTLOOP_VLLM_LOOP``, ...).
- ``shapes(quick, device)``: the loads of ``offline`` and ``online`` (``Shape``: n requests, token counts, rate).
- ``worker_queue_class``, ``worker_reader_wait``, ``worker_reader_chains``, ``worker_read_cpu``,
  ``worker_sim_device`` run in each worker (``collective_rpc``);
  ``check_queue_class`` raises unless every worker runs the arm's queue.
- ``compare_outputs`` / ``identical_goal``: outputs compared across arms and rounds; ``cpu_rows``: the per-process
  CPU rows of a table.

Imports no vLLM: a worker that runs one of the functions above imports this module.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

from hotloop.bench.report import fmt

ARMS = ("vllm", "hotloop", "hotloop+loop")  # vLLM's queue and loop; hotloop's queue; hotloop's queue and loop
# on the simulated device, vLLM's own cheaper spin (its spinloop extension) is a fourth arm
SIM_ARMS = ("vllm", "vllm+spinloop", "hotloop", "hotloop+loop")
BIND = {1: "0", 2: "0|1", 4: "0|1|0|1"}  # TP=4 on the simulated device: its forwards cost no CPU
# selectable with --arms: hotloop's arms with the readers' plain wait (HOTLOOP_VLLM_PACED=0) instead of the paced one
# and hotloop's arms without chained reads (HOTLOOP_VLLM_CHAINS=0: the read after a step's first broadcast parks)
# and hotloop's arms with a 1 ms yield budget before the park (HOTLOOP_VLLM_YIELD_US=1000, the CPU build's default)
# and hotloop's arms with the engine core's outputs handed to vLLM's output thread (HOTLOOP_VLLM_SEND=0) instead of
# sent by the thread that makes them (output_send.py)
# and the loop's arm with the engine core's inputs read by vLLM's input thread (HOTLOOP_VLLM_INPUT_READ=0) instead of
# by its main thread (input_read.py)
EXTRA_ARMS = ("hotloop-plain", "hotloop+loop-plain", "hotloop-nochain", "hotloop+loop-nochain", "hotloop-yield",
              "hotloop+loop-yield", "hotloop-nosend", "hotloop+loop-nosend", "hotloop+loop-noread")


def arms_for(device: str) -> tuple[str, ...]:
    return SIM_ARMS if device == "sim" else ARMS


def arm_env(tp: int, arm: str, device: str = "cpu") -> dict:
    """The environment of a driver process of `arm` at tensor parallel size `tp`, on vLLM's CPU build (`device`
    "cpu") or on the simulated device ("sim": HOTLOOP_VLLM_SIM_DEVICE, its value kept if already set)."""
    sim = {"HOTLOOP_VLLM_SIM_DEVICE": os.environ.get("HOTLOOP_VLLM_SIM_DEVICE") or "1"} if device == "sim" else {}
    # the readers' wait: the plain arms' forced, the others' the host's default (step_wait.choose) unless the
    # bench's own environment sets it
    plain = {"HOTLOOP_VLLM_PACED": "0"} if arm.endswith("-plain") else {}
    if arm.endswith("-nochain"):
        plain["HOTLOOP_VLLM_CHAINS"] = "0"
    if arm.endswith("-yield"):
        plain["HOTLOOP_VLLM_YIELD_US"] = "1000"
    if arm.endswith("-nosend"):
        plain["HOTLOOP_VLLM_SEND"] = "0"
    if arm.endswith("-noread"):
        plain["HOTLOOP_VLLM_INPUT_READ"] = "0"
    return dict(os.environ, **sim, **plain, HOTLOOP_VLLM="0" if arm.startswith("vllm") else "1",
                VLLM_USE_SPINLOOP_EXT="1" if arm == "vllm+spinloop" else "0",
                HOTLOOP_VLLM_LOOP="1" if arm.startswith("hotloop+loop") else "0", HOTLOOP_VLLM_TIMELINE="1",
                HOTLOOP_VLLM_READ_CPU="1",
                VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_CPU_OMP_THREADS_BIND=BIND.get(tp, "auto"), TOKENIZERS_PARALLELISM="false",
                VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                # lets the driver ask each worker which queue class it runs (a function sent by collective_rpc)
                VLLM_ALLOW_INSECURE_SERIALIZATION="1")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One load on a fresh engine: `n` requests of `prompt_tokens` random token ids (seeded) and `output_tokens`
    greedy output tokens each, arriving as a seeded Poisson process of `rate` req/s (0: all at once)."""

    name: str
    n: int
    prompt_tokens: int
    output_tokens: int
    rate: float

    def arrivals(self, seed: int) -> list[float]:
        if self.rate <= 0:
            return [0.0] * self.n
        rng, t, out = random.Random(seed), 0.0, []
        for _ in range(self.n):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out


def shapes(quick: bool, device: str = "cpu") -> list[Shape]:
    """The upstream change's shapes, scaled to a 2-vCPU machine and a tiny model. On the simulated device, the
    upstream shapes' token counts (arrivals 128 / 8, decode 32 / 512, single 32 / 256) with fewer requests."""
    if device == "sim":
        if quick:
            return [Shape("arrivals", 48, 128, 8, 100.0), Shape("poisson", 24, 32, 64, 8.0),
                    Shape("decode", 16, 32, 128, 0.0), Shape("single", 1, 32, 128, 0.0)]
        return [Shape("arrivals", 128, 128, 8, 100.0), Shape("poisson", 64, 32, 64, 8.0),
                Shape("decode", 16, 32, 512, 0.0), Shape("single", 1, 32, 256, 0.0)]
    if quick:
        return [Shape("arrivals", 32, 128, 8, 40.0), Shape("poisson", 24, 16, 32, 4.0),
                Shape("decode", 16, 16, 128, 0.0), Shape("single", 1, 16, 128, 0.0)]
    return [Shape("arrivals", 96, 128, 8, 40.0), Shape("poisson", 64, 16, 32, 4.0),
            Shape("decode", 16, 16, 256, 0.0), Shape("single", 1, 16, 256, 0.0)]


def worker_queue_class(_worker=None):
    """Runs in each worker (collective_rpc): the MessageQueue class vLLM's executor module uses there."""
    mod = sys.modules["vllm.v1.executor.multiproc_executor"]
    return f"{mod.MessageQueue.__module__}.{mod.MessageQueue.__qualname__}"


def worker_reader_wait(_worker=None):
    """Runs in each worker (collective_rpc): the waits its shared-memory readers chose (hotloop.vllm.step_wait:
    kind, cap in us, why), [] on vLLM's own queue."""
    step_wait = sys.modules.get("hotloop.vllm.step_wait")
    return [(w.kind, w.cap_us, w.why) for _name, w in step_wait.chosen] if step_wait else []


def worker_reader_chains(_worker=None):
    """Runs in each worker (collective_rpc): its hotloop readers' chain counters so far
    (hotloop.vllm.step_wait.chain_stats), {} on vLLM's own queue."""
    step_wait = sys.modules.get("hotloop.vllm.step_wait")
    return step_wait.chain_stats() if step_wait else {}


def worker_read_cpu(_worker=None):
    """Runs in each worker (collective_rpc): its queue reads' thread CPU so far (hotloop.vllm.read_cpu.totals), None
    unless HOTLOOP_VLLM_READ_CPU is on."""
    read_cpu = sys.modules.get("hotloop.vllm.read_cpu")
    return read_cpu.totals() if read_cpu else None


def worker_sim_device(_worker=None):
    """Runs in each worker (collective_rpc): the simulated device's step times and TP rank, or None when the model
    computes for real."""
    runner = getattr(_worker, "model_runner", None)
    clock = getattr(getattr(runner, "model", None), "_hotloop_device_clock", None)
    if clock is None:
        return None
    return {"base_us": clock.base_ns / 1e3, "per_token_us": clock.per_token_ns / 1e3, "rank": clock.rank,
            "world": clock.world, "steps": clock.steps,
            "path": "async" if getattr(runner, "use_async_scheduling", False) else "sync"}


def check_queue_class(arm: str, found: list[str]) -> None:
    want = "hotloop.vllm.message_queue.MessageQueue" if not arm.startswith("vllm") else \
        "vllm.distributed.device_communicators.shm_broadcast.MessageQueue"
    if found != [want]:
        raise RuntimeError(f"arm {arm}: the workers use {found}, expected {want}")


def compare_outputs(res: dict, key: str, reference: dict, differ: set, label: str) -> None:
    """Take each shape's outputs (res[shape][key]) out of one engine's figures; the first engine's are the reference,
    a shape whose outputs differ from it is added to `differ` as "<label> <shape>"."""
    for shape, figures in res.items():
        if not isinstance(figures, dict) or key not in figures:
            continue
        outputs = figures.pop(key)
        if shape not in reference:
            reference[shape] = outputs
        elif outputs != reference[shape]:
            differ.add(f"{label} {shape}")


def identical_goal(data: dict, what: str) -> dict:
    return {"goal": f"{what} identical in every arm", "met": data["identical_greedy_outputs"],
            "detail": "yes" if data["identical_greedy_outputs"] else "differ: " + ", ".join(data["outputs_differ"])}


def cpu_rows(data: dict, tps, last) -> list[list]:
    """Per TP and arm: the decode shape's host CPU per process (front end, engine core, each worker), then
    last(tp, arm, pct)'s cells."""
    rows = []
    for tp in tps:
        for arm in data["arms"]:
            pct = data["tp"][tp]["decode"][arm]["cpu_pct"]
            workers = sorted(k for k in pct if k.startswith("worker"))
            rows.append([f"TP={tp} {arm}", fmt(pct.get("front_end", 0.0), 0), fmt(pct.get("engine_core", 0.0), 0),
                         " / ".join(fmt(pct[w], 0) for w in workers)] + last(tp, arm, pct))
    return rows


def sim_spec() -> tuple[float, float]:
    from hotloop.testing.device_clock import DEFAULT_BASE_US, DEFAULT_PER_TOKEN_US

    return DEFAULT_BASE_US, DEFAULT_PER_TOKEN_US


def chain_delta(before: dict, after: dict) -> dict:
    """Chain counters (per kind: reads, parks, chained, wait_us) over a span: after - before."""
    return {k: {f: v - before.get(k, {}).get(f, 0) for f, v in c.items()} for k, c in after.items()
            if c["reads"] - before.get(k, {}).get("reads", 0) > 0}


def read_cpu_delta(before: dict | None, after: dict | None) -> dict | None:
    """Queue reads' thread CPU (read_cpu.totals) over a span: after - before."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after}
