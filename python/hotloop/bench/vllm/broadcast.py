"""The step broadcast's cost to its writer at TP=4 on two nodes (2 + 2), vLLM's own MessageQueue against hotloop's,
in one run: ``python -m hotloop.bench.vllm.broadcast [--quick]`` (part of ``hotloop bench vllm-ray``).

Method: the writer is this process, as vLLM's executor is: a queue of 4 readers, 2 on the writer's node (shared
memory) and 2 on another node (ranks 2 and 3, processes of their own that name their node "far":
``HOTLOOP_NODE_ID``; TCP over loopback, so every arm pays the same kernel), written at a step cadence (one
broadcast every ``PERIOD_S``; the writer sleeps between them, as the engine core waits for the step) with an
object shaped like a decode step's scheduler output (``payload`` bytes in a tuple, pickled by the queue). Arms:

- ``vllm``: vLLM's own class (``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``): one ZeroMQ
  XPUB socket, one stream per remote rank, no encryption;
- ``hotloop``: ``hotloop.vllm.MessageQueue`` as the plugin installs it: the far node's two ranks share one
  CurveZMQ stream into that node's relay, which writes a shared-memory ring the two read;
- ``hotloop-direct``: the same queue with each remote rank on its own stream (``node=""``): what the relay saves.

Per arm: the writer's CPU per broadcast (the process's user + system time over the run, its ZeroMQ I/O threads
included, less the CPU of the same pacing loop without broadcasts, measured right after, divided by the
broadcasts: what the writer's node pays) and the ``enqueue`` call's wall time p50 / p99
(what the engine core's thread waits). Every reader counts what it read; a run where one missed a message fails.
Each figure is the median over ``runs`` runs that alternate the arms. Goal: hotloop's CPU per broadcast <= 0.6x
vLLM's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

from hotloop.bench.report import Goal, check_goals, fmt, median, percentile, print_result, table

CTX = mp.get_context("fork")
ARMS = ("vllm", "hotloop", "hotloop-direct")
PERIOD_S = 1.4e-3
N_READERS, N_LOCAL = 4, 2
LOOPBACK = "127.0.0.1"


def _queue_class(arm: str):
    if arm == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    else:
        from hotloop.vllm.message_queue import MessageQueue
    return MessageQueue


def _reader(arm: str, handle, rank: int, count: int, out) -> None:
    if arm == "vllm":
        q = _queue_class(arm).create_from_handle(handle, rank)
    else:  # the far node's ranks name it; a direct reader names none
        from hotloop import MessageQueue

        node = None if rank < N_LOCAL else ("" if arm == "hotloop-direct" else "far")
        q = MessageQueue.create_from_handle(handle.queue, rank, node=node)
    q.wait_until_ready()
    got = 0
    for _ in range(count):
        q.dequeue(timeout=60)
        got += 1
    out.put((rank, got))
    out.close()
    out.join_thread()
    os._exit(0)


def _cpu_s() -> float:
    return time.process_time()  # every thread of this process, ZeroMQ's I/O threads included


def _paced(count: int, broadcast=None) -> tuple[float, list[float]]:
    """`count` periods of PERIOD_S, calling `broadcast()` at the start of each (none: the pacing alone, whose CPU
    every arm has subtracted); returns (this process's CPU seconds over them, each call's wall time in us)."""
    walls = []
    next_at = time.monotonic()
    cpu0 = _cpu_s()
    for _ in range(count):
        next_at += PERIOD_S
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the engine core waits for the step; this benchmark's pacing, not a data path
        t0 = time.perf_counter_ns()
        if broadcast is not None:
            broadcast()
        walls.append((time.perf_counter_ns() - t0) / 1e3)
    return _cpu_s() - cpu0, walls


def one_run(arm: str, count: int, payload: int) -> dict:
    cls = _queue_class(arm)
    mq = cls(N_READERS, N_LOCAL, max_chunk_bytes=1024 * 1024 * 4, connect_ip=LOOPBACK)
    handle = mq.export_handle()
    out = CTX.Queue()
    procs = [CTX.Process(target=_reader, args=(arm, handle, r, count + 1, out)) for r in range(N_READERS)]
    for p in procs:
        p.start()
    mq.wait_until_ready()
    step = ("execute_model", (b"s" * payload, list(range(16))), {}, 0)
    mq.enqueue(step)  # the first one: connections warm
    cpu, walls = _paced(count, lambda: mq.enqueue(step))
    got = dict(out.get(timeout=120) for _ in procs)  # every reader read every message
    cpu -= _paced(count)[0]
    for p in procs:
        p.join(30)
    mq.shutdown()
    if any(n != count + 1 for n in got.values()):
        raise RuntimeError(f"{arm}: a reader missed messages: {got}")
    return {"cpu_us": cpu / count * 1e6, "enqueue_p50_us": percentile(walls, 50),
            "enqueue_p99_us": percentile(walls, 99)}


def run(quick: bool = True, runs: int | None = None, payloads=(2048, 65536)) -> tuple[dict, str]:
    runs = runs or (3 if quick else 7)
    count = 1000 if quick else 3000
    data = {"runs": runs, "count": count, "period_ms": PERIOD_S * 1e3, "payloads": {}}
    rows = []
    for payload in payloads:
        raw = {arm: [] for arm in ARMS}
        for _ in range(runs):
            for arm in ARMS:
                raw[arm].append(one_run(arm, count, payload))
        res = {arm: {k: median([r[k] for r in raw[arm]]) for k in raw[arm][0]} for arm in ARMS}
        for arm in ARMS:
            res[arm]["cpu_us_runs"] = [r["cpu_us"] for r in raw[arm]]
        data["payloads"][str(payload)] = res
        base = res["vllm"]["cpu_us"]
        for arm in ARMS:
            r = res[arm]
            rows.append([f"{payload // 1024} KiB", arm, fmt(r["cpu_us"]), f"{r['cpu_us'] / base:.2f}x",
                         fmt(r["enqueue_p50_us"]), fmt(r["enqueue_p99_us"])])
    goals = [Goal(f"writer CPU per broadcast at TP=4 (2 + 2), {p // 1024} KiB steps: hotloop <= 0.6x vLLM's own",
                  "payloads", f"{p}.hotloop", "cpu_us", "<=", 0.6, against=f"{p}.vllm") for p in payloads]
    data["goals"] = check_goals(goals, data)
    text = str(table(f"Step broadcast to 4 ranks, 2 on the writer's node and 2 on another, one every "
                     f"{PERIOD_S * 1e3:.1f} ms, {count} broadcasts, median of {runs} runs alternating the arms",
                     ["step", "queue", "writer CPU us/broadcast", "vs vLLM", "enqueue p50 us", "enqueue p99 us"],
                     rows))
    return data, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.broadcast", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    args = ap.parse_args(argv)
    data, text = run(args.quick, args.runs)
    return print_result("vllm-broadcast", data, text)


if __name__ == "__main__":
    raise SystemExit(main())
