"""The engine core's output send against vLLM's output thread, small outputs and large ones (logprobs, pooling), in
one run: ``python -m hotloop.bench.vllm.output_encode [--quick] [--json PATH]`` (needs vLLM: its encoder, outputs).

Method: this process plays the engine core's main thread on vLLM's async scheduling path (two steps in flight):
it waits for step k's end (a sleep, the GIL released, as a wait for the step's result releases it), puts step k's
outputs into ``hotloop.vllm.output_send``'s ``OutputQueue`` (vLLM's real ``EngineCoreOutputs`` and
``MsgpackEncoder``, the output thread and its PUSH socket as the plugin installs them), does the next schedule's
work (a fixed amount of Python, ``SCHEDULE_US`` of it when alone, the GIL held as vLLM's scheduler holds it) and
launches step k+2, which the device runs for the regime's step time from its launch or the end of step k+1,
whichever is later. Regimes (``REGIMES``): ``device-bound`` (a 5 ms step: the host's work fits inside it) and
``host-bound`` (0.3 ms: every microsecond of the main thread's is on the step's path). A second process is the
front end: its PULL socket receives each message and decodes it with vLLM's ``MsgpackDecoder``. Shapes: a decode
step's outputs at batch 16 and 256, the same with 20 logprobs per token (vLLM slices them per request: three small
arrays each), and pooling outputs (a 1024-float tensor per request). Arms:

- ``vllm``: vLLM's own output thread (``EngineCoreProc.process_output_sockets`` on a ``queue.Queue``, as with
  ``HOTLOOP_VLLM_SEND=0``): every output handed to it;
- ``hotloop``: ``hotloop.vllm.output_send`` as the plugin installs it: an output with nothing queued ahead of it
  encoded and sent by the putting thread.

Per regime, shape and arm: the main thread's steps per second; the outputs decoded per second (the run's steps
over the time from its start to the front end's last decode: what a user receives); the main thread's time from
the put to the end of the next schedule (p50 / p99); the output's latency from the put to the front end's decoded
message (p50 / p99) and its ratio to vLLM's; how hotloop's outputs went (direct / queued). Medians over ``runs``
runs that alternate the arms. The encoding alone, per shape, is timed first (``encode_into``, p50 over 200).
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time
import types
import uuid

from hotloop.bench.report import fmt, median, percentile, table

REGIMES = {"device-bound": 5000.0, "host-bound": 300.0}  # the device's step, us
SCHEDULE_US = 300.0
ARMS = ("vllm", "hotloop")
SHAPES = {  # name: (batch, logprobs per token, pooling floats per request)
    "decode 16": (16, 0, 0),
    "decode 256": (256, 0, 0),
    "logprobs 16": (16, 20, 0),
    "logprobs 256": (256, 20, 0),
    "pooling 64": (64, 0, 1024),
}

_FRONT_END = r"""
import json, sys, time, zmq
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder
addr = sys.argv[1]
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.bind(addr)
decoder = MsgpackDecoder(EngineCoreOutputs)
print("ready", flush=True)
lat = []
while True:
    frames = pull.recv_multipart(copy=False)
    if bytes(frames[0].buffer) == b"ENGINE_CORE_DEAD":
        break
    out = decoder.decode(frames)
    lat.append((time.monotonic() - out.timestamp) * 1e6)
print(json.dumps({"latency_us": lat, "last": time.monotonic()}), flush=True)
"""


def _outputs(batch: int, logprobs: int, pool: int) -> list:
    import numpy as np
    import torch
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import LogprobsLists

    rng = np.random.default_rng(0)
    outs = []
    for i in range(batch):
        lp = None
        if logprobs:  # one token's logprobs, as the scheduler slices them per request
            lp = LogprobsLists(rng.integers(0, 32000, (1, logprobs + 1), dtype=np.int32),
                               rng.standard_normal((1, logprobs + 1), dtype=np.float32), np.zeros(1, np.int32))
        outs.append(EngineCoreOutput(request_id=f"cmpl-{uuid.UUID(int=i).hex}", new_token_ids=[1000 + i],
                                     new_logprobs=lp, pooling_output=torch.ones(pool) if pool else None))
    return outs


def _schedule_work(us: float) -> int:
    """The loop count of a Python loop that takes `us` alone here (calibrated once, median of 5)."""
    n = 20000
    times = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        _spin(n)
        times.append(time.perf_counter_ns() - t0)
    return max(1, int(n * us * 1e3 / median(times)))


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def encode_p50_us(outs, reps: int = 200) -> float:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackEncoder

    enc, buf, times = MsgpackEncoder(), bytearray(), []
    msg = EngineCoreOutputs(engine_index=0, outputs=outs)
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        enc.encode_into(msg, buf)
        times.append(time.perf_counter_ns() - t0)
    return median(times) / 1e3


def _attach_signalled(output_send):
    """hotloop's OutputQueue that says when its output thread has opened its sockets (an event, not a poll)."""

    class AttachSignalled(output_send.OutputQueue):
        def __init__(self):
            super().__init__()
            self.attached = threading.Event()

        def attach(self, sender) -> None:
            super().attach(sender)
            if sender is not None:
                self.attached.set()

    return AttachSignalled()


def _drive(q, outs, steps: int, work: int, device_us: float) -> tuple[list[float], int, float]:
    """The engine core's main thread on the async path, two steps in flight: the device runs step k for device_us
    from its launch or the end of step k-1, whichever is later; the main thread waits for step k's end (the GIL
    released), puts its outputs, schedules and launches step k+2. (put + next schedule per step in us, the start
    on CLOCK_MONOTONIC in ns, the steps' seconds)."""
    from vllm.v1.engine import EngineCoreOutputs

    critical = []
    ends = [time.monotonic_ns() + device_us * 1e3]  # step 0, in flight already
    ends.append(ends[0] + device_us * 1e3)
    t_start = time.monotonic_ns()
    for k in range(steps):
        left = ends[k] - time.monotonic_ns()
        if left > 0:
            time.sleep(left / 1e9)  # the step's result: the GIL released
        t0 = time.perf_counter_ns()
        q.put_nowait((0, EngineCoreOutputs(engine_index=0, outputs=outs, timestamp=time.monotonic())))
        _spin(work)  # the next schedule
        critical.append((time.perf_counter_ns() - t0) / 1e3)
        ends.append(max(time.monotonic_ns(), ends[k + 1]) + device_us * 1e3)  # step k+2 launched
    return critical, t_start, (time.monotonic_ns() - t_start) / 1e9


def run_arm(outs, arm: str, steps: int, work: int, device_us: float) -> dict:
    """One arm on one shape: `steps` steps through a fresh output thread to a fresh front-end process."""
    import vllm.v1.engine.core as core_mod

    from hotloop.vllm import output_send

    addr = f"ipc:///tmp/hotloop-output-encode-{uuid.uuid4().hex}"
    fe = subprocess.Popen([sys.executable, "-c", _FRONT_END, addr], stdout=subprocess.PIPE, text=True,
                          stderr=subprocess.DEVNULL)
    try:
        if fe.stdout.readline().strip() != "ready":
            raise RuntimeError("the front-end process did not start (vLLM importable?)")
        if arm == "vllm":  # vLLM's output thread, on the engine core's plain queue.Queue
            core = object.__new__(core_mod.EngineCoreProc)
            core.output_queue = queue.Queue()
            target = core_mod.EngineCoreProc.process_output_sockets
        else:
            core = types.SimpleNamespace(output_queue=_attach_signalled(output_send))
            target = output_send.process_output_sockets
        thread = threading.Thread(target=target, args=(core, [addr], None, 0), daemon=True)
        thread.start()
        q = core.output_queue
        # hotloop's: its sockets open before the first put, as in an engine core (the handshake comes first)
        if arm != "vllm" and not q.attached.wait(10):
            raise RuntimeError("hotloop's output thread did not open its socket within 10 s")
        critical, t_start, elapsed_s = _drive(q, outs, steps, work, device_us)
        q.put_nowait(core_mod.EngineCoreProc.ENGINE_CORE_DEAD)
        thread.join(30)
        out, _ = fe.communicate(timeout=60)
        got = json.loads(out.strip().splitlines()[-1])
        latency, delivered_s = got["latency_us"], got["last"] - t_start / 1e9
    finally:
        if fe.poll() is None:
            fe.kill()
            fe.wait()
    if len(latency) != steps:
        raise RuntimeError(f"the front end decoded {len(latency)} of {steps} outputs")
    return {"steps_per_s": steps / elapsed_s, "delivered_per_s": steps / delivered_s,
            "critical_p50_us": median(critical), "critical_p99_us": percentile(critical, 99),
            "latency_p50_us": median(latency), "latency_p99_us": percentile(latency, 99),
            "direct": getattr(q, "direct", 0), "queued": getattr(q, "queued", steps + 1) - 1}  # less the end mark


def run(quick: bool = False, runs: int | None = None) -> tuple[dict, str]:
    runs = runs or (2 if quick else 3)
    steps = 100 if quick else 300
    work = _schedule_work(SCHEDULE_US)
    shapes = {name: _outputs(*spec) for name, spec in SHAPES.items()}
    encode = {name: encode_p50_us(outs) for name, outs in shapes.items()}
    per = {(g, s, a): [] for g in REGIMES for s in shapes for a in ARMS}
    for r in range(runs):
        for g, device_us in REGIMES.items():
            for s, outs in shapes.items():
                for a in (list(ARMS) if r % 2 == 0 else list(reversed(ARMS))):
                    print(f"[output encode] run {r + 1}/{runs}: {g}, {s}, {a}", file=sys.stderr, flush=True)
                    per[g, s, a].append(run_arm(outs, a, steps, work, device_us))
    keys = ("steps_per_s", "delivered_per_s", "critical_p50_us", "critical_p99_us", "latency_p50_us",
            "latency_p99_us", "direct", "queued")
    results = {g: {s: {"encode_p50_us": encode[s],
                       "arms": {a: {k: median([x[k] for x in per[g, s, a]]) for k in keys} for a in ARMS}}
                   for s in shapes} for g in REGIMES}
    parts = []
    for g, device_us in REGIMES.items():
        rows = []
        for s in shapes:
            base = results[g][s]["arms"]["vllm"]
            for a in ARMS:
                m = results[g][s]["arms"][a]
                rows.append([s, fmt(encode[s]) if a == "vllm" else "", a,
                             f"{m['steps_per_s']:.0f} / {m['delivered_per_s']:.0f}",
                             f"{fmt(m['critical_p50_us'])} / {fmt(m['critical_p99_us'])}",
                             f"{fmt(m['latency_p50_us'])} / {fmt(m['latency_p99_us'])}",
                             f"{m['latency_p50_us'] / base['latency_p50_us']:.2f}",
                             f"{m['direct']:.0f} / {m['queued']:.0f}" if a != "vllm" else "-"])
        parts.append(str(table(
            f"{g}: the device's step {device_us / 1e3:g} ms, {SCHEDULE_US:g} us of schedule after each put, two "
            f"steps in flight; {steps} steps a run, medians over {runs} runs (us)",
            ["shape", "encode p50", "arm", "steps / outputs decoded per s", "put + next schedule p50 / p99",
             "put -> front end decoded p50 / p99", "latency p50 x vLLM's", "direct / queued"], rows)))
    parts.append("vllm: vLLM's output thread takes every output; hotloop: the putting thread sends an output with "
                 "nothing queued ahead of it (hotloop.vllm.output_send). Steps per second: the main thread's; outputs "
                 "decoded per second: the run's steps over the time until the front end decoded the last one (where "
                 "an output thread falls behind, the main thread runs ahead of the outputs and their latency grows).")
    data = {"schedule_us": SCHEDULE_US, "regimes_device_us": REGIMES, "steps": steps, "runs": runs,
            "regimes": results}
    return data, "\n\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.output_encode",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    data, text = run(args.quick, args.runs)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
