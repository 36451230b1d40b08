"""Remote readers on two nodes, each connected on its own (direct) or through its node's relay, in one run.

Part (f) of ``hotloop bench queue``; ``python -m hotloop.bench.relay_bench [--quick]`` prints it alone. Every
reader is a process of its own on this machine; the two "nodes" are names (``create_from_handle(node=...)``),
so both arms cross TCP loopback with CurveZMQ and differ only in how many streams the writer feeds:

- fan-out: one writer, one local reader and k remote readers, ranks alternating between node a and node b,
  ``count`` messages of 256 KiB (``enqueue_bytes``; readers take zero-copy views where they can): the writer's
  throughput, MB of its message stream per second from its first enqueue until the last reader has the last
  message. Direct: k streams, each encrypted and sent on its own; relay: two (one per node), then shared memory.
  Goal: with the relay, 8 remote ranks >= 0.8x the throughput of 2.
- round trip: 64 B to one remote rank and back (its answer on a queue of its own, read remotely by the writer's
  process): the rank connected directly, or behind its node's relay (a second rank of the node runs the relay),
  next to the shared-memory round trip. Goal: relayed p50 <= direct p50 + 2x the shared-memory p50.

Each figure is the median over ``runs`` runs that alternate the arms (run 1 of every arm, then run 2, ...).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from hotloop import MessageQueue
from hotloop.bench.report import Goal, check_goals, fmt, median, percentile, table

CTX = mp.get_context("fork")
LOOPBACK = "127.0.0.1"
BIG = 256 * 1024
NODES = ("node-a", "node-b")


def _report(out, value):
    """Child side: hand `value` to the parent, then exit at once (its queue's feeder thread flushed first)."""
    out.put(value)
    out.close()
    out.join_thread()
    os._exit(0)


def _node(relay: bool, i: int) -> str:
    return NODES[i % 2] if relay else ""


def _fan_out_reader(handle, rank, node, count, out):
    q = MessageQueue.create_from_handle(handle, rank, node=node)
    out.put(("attached", rank))
    for _ in range(count):
        with q.acquire_read(timeout=120):
            pass
    q.close()
    _report(out, ("done", time.perf_counter()))


def fan_out(k: int, relay: bool, count: int) -> float:
    """MB/s of the writer's message stream to one local and k remote readers (see module doc)."""
    mq = MessageQueue(1 + k, 1, connect_ip=LOOPBACK)
    handle = mq.export_handle()
    out = CTX.Queue()
    kids = [CTX.Process(target=_fan_out_reader, args=(handle, r, _node(relay, i) if r else None, count, out))
            for i, r in enumerate(range(1 + k))]
    for p in kids:
        p.start()
    for _ in kids:
        assert out.get(timeout=60)[0] == "attached"
    mq.wait_until_ready(60)
    payload = bytes(BIG)
    t0 = time.perf_counter()
    for _ in range(count):
        mq.enqueue_bytes(payload, timeout=120)
    last = max(out.get(timeout=180)[1] for _ in kids)
    for p in kids:
        p.join(30)
    mq.close()
    return count * BIG / (last - t0) / 1e6


def _echo(handle, rank, node, rounds, back_out, out):
    """Echo `rounds` messages back on a queue of its own: read remotely, or locally when `node` is None (the
    shared-memory arm)."""
    q = MessageQueue.create_from_handle(handle, rank, node=node)
    back = MessageQueue(1) if node is None else MessageQueue(1, 0, connect_ip=LOOPBACK)
    back_out.put(back.export_handle())
    back.wait_until_ready(60)
    for _ in range(rounds):
        back.enqueue_bytes(q.dequeue_bytes(timeout=60))
    back.close()
    q.close()
    _report(out, "done")


def _sink(handle, rank, node, rounds, out):
    q = MessageQueue.create_from_handle(handle, rank, node=node)
    for _ in range(rounds):
        q.dequeue_bytes(timeout=60)
    q.close()
    _report(out, "done")


def round_trip(arm: str, rounds: int, warmup: int) -> dict:
    """64 B round trip to one rank and back, us: arm "direct", "relayed" or "shared memory"."""
    n = rounds + warmup
    out, back_out = CTX.Queue(), CTX.Queue()
    if arm == "shared memory":
        mq = MessageQueue(1)
        kids = [CTX.Process(target=_echo, args=(mq.export_handle(), 0, None, n, back_out, out))]
    else:
        # relayed: rank 0 runs node a's relay (it comes first), rank 1 echoes through it; direct: rank 1 alone
        mq = MessageQueue(2, 0, connect_ip=LOOPBACK)
        node = "node-a" if arm == "relayed" else ""
        kids = [CTX.Process(target=_sink, args=(mq.export_handle(), 0, node, n, out))]
        kids[0].start()
        kids.append(CTX.Process(target=_echo, args=(mq.export_handle(), 1, node, n, back_out, out)))
    for p in kids:
        if p.pid is None:
            p.start()
    back = MessageQueue.create_from_handle(back_out.get(timeout=60), 0, node="")
    mq.wait_until_ready(60)
    msg, lat = bytes(64), []
    for i in range(n):
        t0 = time.perf_counter_ns()
        mq.enqueue_bytes(msg)
        back.dequeue_bytes(timeout=60)
        if i >= warmup:
            lat.append(time.perf_counter_ns() - t0)
    for _ in kids:
        out.get(timeout=60)
    for p in kids:
        p.join(30)
    back.close()
    mq.close()
    return {"p50_us": percentile(lat, 50) / 1e3, "p99_us": percentile(lat, 99) / 1e3}


KS = (1, 2, 4, 8)
RT_ARMS = ("direct", "relayed", "shared memory")


def run(quick: bool = False, runs: int = 5, progress=None):
    """The fan-out series and the round trips; returns (data, [tables])."""
    count = 100 if quick else 400
    rounds, warmup = (300, 30) if quick else (3000, 300)
    fan: dict[str, list[float]] = {f"{arm} k={k}": [] for arm in ("direct", "relay") for k in KS}
    rts: dict[str, list[dict]] = {arm: [] for arm in RT_ARMS}
    for i in range(runs):
        for k in KS:
            for arm in ("direct", "relay"):
                if progress:
                    progress.step(f"run {i + 1}/{runs}: fan-out {arm} k={k}")
                fan[f"{arm} k={k}"].append(fan_out(k, arm == "relay", count))
        for arm in RT_ARMS:
            if progress:
                progress.step(f"run {i + 1}/{runs}: round trip {arm}")
            rts[arm].append(round_trip(arm, rounds, warmup))
    data = {
        "fan_out_MBps": {row: {"MBps": median(v), "runs": v} for row, v in fan.items()},
        "relay_round_trip_us": {arm: {"p50_us": median([r["p50_us"] for r in v]),
                                      "p99_us": median([r["p99_us"] for r in v]), "runs": v}
                                for arm, v in rts.items()},
    }
    f = data["fan_out_MBps"]
    frows = [[f"k={k}", fmt(f[f"direct k={k}"]["MBps"]), fmt(f[f"relay k={k}"]["MBps"]),
              fmt(f[f"direct k={k}"]["MBps"] / f["direct k=2"]["MBps"], 2),
              fmt(f[f"relay k={k}"]["MBps"] / f["relay k=2"]["MBps"], 2),
              fmt(f[f"relay k={k}"]["MBps"] / f[f"direct k={k}"]["MBps"], 2)] for k in KS]
    r = data["relay_round_trip_us"]
    budget = r["direct"]["p50_us"] + 2 * r["shared memory"]["p50_us"]
    rrows = [[arm, fmt(r[arm]["p50_us"]), fmt(r[arm]["p99_us"])] for arm in RT_ARMS]
    tables = [
        table(f"(f) fan-out to k remote ranks on 2 nodes, 256 KiB messages: the writer's MB/s ({count} messages; "
              f"median of {runs} alternating runs)",
              ["remote ranks", "direct MB/s", "relay MB/s", "direct / direct k=2", "relay / relay k=2",
               "relay / direct"], frows,
              note="One local reader too. Direct: a CurveZMQ stream per rank; relay: one per node, then the node's "
              "shared-memory ring (the nodes are names on this machine: both arms cross TCP loopback). Goal: relay "
              "k=8 >= 0.8x relay k=2.", key="fan_out_MBps"),
        table(f"(f) 64 B round trip to a remote rank, us (median of {runs} alternating runs of {rounds} after "
              f"{warmup} warm-up)", ["rank", "p50", "p99"], rrows,
              note=f"The answer comes back on a queue of the rank's own, read remotely. Goal: relayed p50 <= direct "
              f"p50 + 2x shared memory p50 = {budget:.1f} us.", key="relay_round_trip_us"),
    ]
    return data, tables


def goals(data: dict) -> list[Goal]:
    out = [Goal("(f) relay: 8 remote ranks on 2 nodes >= 0.8x the writer throughput of 2", "fan_out_MBps",
                "relay k=8", "MBps", ">=", 0.8, against="relay k=2", unit="MB/s")]
    rt = data.get("relay_round_trip_us", {})
    if "direct" in rt and "shared memory" in rt:
        budget = rt["direct"]["p50_us"] + 2 * rt["shared memory"]["p50_us"]
        out.append(Goal(f"(f) relay: a relayed rank's 64 B round trip p50 <= direct p50 + 2x shared memory p50 "
                        f"({budget:.1f} us in this run)", "relay_round_trip_us", "relayed", "p50_us", "<=",
                        budget, unit="us"))
    return out


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.relay_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    data, tables = run(a.quick, a.runs)
    data["goals"] = check_goals(goals(data), data)
    for t in tables:
        print(t)
        print()
    for g in data["goals"]:
        print(f"{'met' if g['met'] else 'NOT met'}: {g['says']} ({fmt(g['value'], 2)})")
    if a.json:
        import json

        with open(a.json, "w") as fh:
            json.dump(data, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
