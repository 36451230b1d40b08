"""Do live connections ride out sustained packet loss, and is a partition still seen in time?

    python -m hotloop.bench.loss_survival [--minutes M] [--loss 2,5] [--idle N] [--links N] [--busy-rate R]
                                          [--rounds K] [--short-cuts] [--json PATH]
    (root, iproute2 and nftables: simulated nodes, as tests/test_network_faults.py)

One writer node and one reader node per loss level (network namespaces joined by veth links,
``hotloop.testing.netns.Nodes``). Between the writer's node and each reader node: ``--idle`` remote queues that
carry one message every ``IDLE_EVERY_S`` (idle connections, kept alive by the peer-timeout timers alone), one
queue at ``--busy-rate`` messages a second, and ``--links`` liveness links (``hotloop.engine.executors.liveness``,
idle). Each round: every connection made, then N % of the reader node's packets dropped each way (nftables
``numgen random``) for ``--minutes``; with ``--short-cuts`` every ~``SHORT_CUT_EVERY_S`` s each node is also cut for
0.3-1.0 s on top of the loss. Then the loss is lifted and every reader node is cut for good (a partition): each
end of each connection must see it, and the time from the cut is recorded.

Prints, per loss level: connection-minutes under loss, connections lost while their peer was alive (by kind and
end; the goal is 0), messages lost / duplicated / out of order (each reader checks its sequence numbers; the
goal is 0), and the time from the partition to each end's error (p50 / p99 / max; the goal: p99 <= 5 s with the
default ``HOTLOOP_PEER_TIMEOUT_S`` of 3 s). Exit 0 when every goal holds.

The processes on the nodes run this file too (``_writer`` / ``_reader``), so a checkout's older library can be
measured with the same script (``PYTHONPATH`` pointing at it).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import queue
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time

IDLE_EVERY_S = 20.0  # an idle queue's writer sends one message this often (its reader checks the sequence)
WRITER_LOOK_S = 0.05  # how often an idle queue's writer looks whether its reader is still attached
SHORT_CUT_EVERY_S = 30.0  # mean gap between short cuts on one node (--short-cuts)
DETECT_WAIT_S = 20.0  # how long the partition's verdicts are waited for
GOAL_P99_S = 5.0


_say_lock = threading.Lock()


def say(**msg):
    """One JSON line on stdout (whole: the node's threads report at once when a partition begins)."""
    with _say_lock:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


# ---- on the nodes ----


def _writer(cfg_json: str) -> None:
    """The writer's node: every queue's writer and the engine's end of every liveness link."""
    cfg = json.loads(cfg_json)
    queues = _export_queues(cfg)
    watcher = _connect_links(cfg)
    watcher.start()
    for q in queues.values():
        q.wait_until_ready(timeout=60)
    say(ready=True, t=time.monotonic())
    for name, q in queues.items():
        sender, args = (_send_busy, (name, q, cfg["busy_rate"])) if name.endswith("busy") else (_send_idle, (name, q))
        threading.Thread(target=sender, args=args, daemon=True).start()
    sys.stdin.read()  # until the parent ends the round
    os._exit(0)  # the connections end with the process (a partitioned peer's would hold close() for its linger)


def _export_queues(cfg: dict) -> dict:
    """Each reader node's idle queues and busy queue, their handles written for the node to attach: {name: queue}."""
    from hotloop import MessageQueue

    work = cfg["workdir"]
    queues = {}
    for node in cfg["readers"]:
        handles = {}
        for name in [f"{node}/idle{i}" for i in range(cfg["idle"])] + [f"{node}/busy"]:
            queues[name] = MessageQueue(1, 0, connect_ip=cfg["writer_addr"], dead_reader="raise")
            handles[name] = queues[name].export_handle()
        with open(os.path.join(work, f"{node}.handles.part"), "wb") as f:
            pickle.dump(handles, f)
        os.rename(os.path.join(work, f"{node}.handles.part"), os.path.join(work, f"{node}.handles"))
    return queues


def _connect_links(cfg: dict):
    """The engine's end of every reader node's liveness links (once the node wrote its ports): a LinkWatcher."""
    from hotloop.engine.executors import liveness

    names_of = {}
    watcher = liveness.LinkWatcher(lambda rank, why: say(lost=names_of[rank], end="engine", t=time.monotonic(),
                                                         error=why))
    token = bytes.fromhex(cfg["token"])
    for node in cfg["readers"]:
        path = os.path.join(cfg["workdir"], f"{node}.ports")
        while not os.path.exists(path):  # set-up only: the node writes it once its listeners are open
            time.sleep(0.05)
        with open(path) as f:
            addr, ports = json.load(f)
        for i, port in enumerate(ports):
            rank = len(names_of)
            names_of[rank] = f"{node}/link{i}"
            watcher.connect(rank, addr, port, token, 10.0)
    return watcher


def _send_idle(name: str, q) -> None:
    """An idle queue's writer: a message every IDLE_EVERY_S, and a look at its reader every WRITER_LOOK_S."""
    sent, next_send = 0, time.monotonic() + IDLE_EVERY_S * random.random()
    while True:
        try:
            if 0 not in q.network_stats["attached"]:
                say(lost=name, end="writer", t=time.monotonic(), error="its reader left", sent=sent)
                return
            if time.monotonic() >= next_send:
                q.enqueue({"i": sent}, timeout=10)
                sent += 1
                next_send += IDLE_EVERY_S
        except Exception as e:  # noqa: BLE001  (reported)
            say(lost=name, end="writer", t=time.monotonic(), error=f"{type(e).__name__}: {e}", sent=sent)
            return
        time.sleep(WRITER_LOOK_S)  # a look at the peers: the writer end of an idle queue has no wait of its own


def _send_busy(name: str, q, rate: float) -> None:
    """A busy queue's writer: `rate` messages a second until its enqueue raises."""
    period, sent = 1.0 / rate, 0
    next_send = time.monotonic()
    while True:
        try:
            q.enqueue({"i": sent, "pad": b"x" * 200}, timeout=10)
        except Exception as e:  # noqa: BLE001  (reported)
            say(lost=name, end="writer", t=time.monotonic(), error=f"{type(e).__name__}: {e}", sent=sent)
            return
        sent += 1
        next_send += period
        time.sleep(max(0.0, next_send - time.monotonic()))


def _reader(cfg_json: str, node: str) -> None:
    """A reader node: each queue's reader and the rank's end of each liveness link."""
    from hotloop import MessageQueue
    from hotloop.engine.executors import liveness

    cfg = json.loads(cfg_json)
    work, token = cfg["workdir"], bytes.fromhex(cfg["token"])
    path = os.path.join(work, f"{node}.handles")
    while not os.path.exists(path):
        time.sleep(0.05)
    with open(path, "rb") as f:
        handles = pickle.load(f)

    def read(name, q):
        got = gaps = dup = ooo = 0
        last = -1
        while True:
            try:
                i = q.dequeue(timeout=None)["i"]
            except Exception as e:  # noqa: BLE001
                say(lost=name, end="reader", t=time.monotonic(), error=f"{type(e).__name__}: {e}", got=got,
                    gaps=gaps, dup=dup, ooo=ooo)
                return
            got += 1
            if i == last + 1:
                last = i
            elif i > last + 1:
                gaps += i - last - 1
                last = i
            elif i == last:
                dup += 1
            else:
                ooo += 1

    for name, h in handles.items():
        q = MessageQueue.create_from_handle(h, 0)
        threading.Thread(target=read, args=(name, q), daemon=True).start()
    ports = []
    for i in range(cfg["links"]):
        listener = liveness.listen(cfg["addr"][node])
        ports.append(listener.getsockname()[1])
        name = f"{node}/link{i}"
        threading.Thread(target=liveness.hold, daemon=True, args=(
            listener, token, 60.0,
            lambda why, name=name: say(lost=name, end="rank", t=time.monotonic(), error=why or "closed by the engine"))
        ).start()
    with open(os.path.join(work, f"{node}.ports.part"), "w") as f:
        json.dump([cfg["addr"][node], ports], f)
    os.rename(os.path.join(work, f"{node}.ports.part"), os.path.join(work, f"{node}.ports"))
    say(attached=True)
    sys.stdin.read()
    os._exit(0)


# ---- the parent ----


class Child:
    def __init__(self, nodes, node, argv):
        self.proc = nodes.popen(node, [sys.executable, os.path.abspath(__file__), *argv], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                sys.stderr.write(line)
        self.lines.put(None)

    def take(self) -> list[dict]:
        out = []
        while True:
            try:
                msg = self.lines.get_nowait()
            except queue.Empty:
                return out
            if msg is None:
                raise RuntimeError(f"a node's process ended (exit {self.proc.wait()})")
            out.append(msg)

    def wait_for(self, key, timeout=90.0) -> tuple[dict, list[dict]]:
        deadline, seen = time.monotonic() + timeout, []
        while True:
            msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if msg is None:
                raise RuntimeError(f"a node's process ended (exit {self.proc.wait()}) before {key!r}")
            if key in msg:
                return msg, seen
            seen.append(msg)

    def stop(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def _round(args, losses, stats, rng):
    """One round: the reader nodes under their loss for args.minutes (short cuts on top with args.short_cuts), then
    every reader node cut off for good; what was lost during the loss and how fast the cut was seen go to `stats`."""
    from hotloop.testing.netns import Nodes

    readers = [f"l{p}" for p in losses]
    kinds = {f"{n}/{what}{i}" for n in readers for what, count in (("idle", args.idle), ("link", args.links))
             for i in range(count)} | {f"{n}/busy" for n in readers}
    lost: dict[tuple[str, str], dict] = {}  # (connection, end) -> its line
    with Nodes(["w", *readers]) as nodes, tempfile.TemporaryDirectory(prefix="hotloop-loss-") as work:
        cfg = dict(workdir=work, token=secrets.token_hex(16), readers=readers, idle=args.idle, links=args.links,
                   busy_rate=args.busy_rate, writer_addr=nodes.addr["w"], addr=nodes.addr)
        writer = Child(nodes, "w", ["_writer", json.dumps(cfg)])
        kids = {node: Child(nodes, node, ["_reader", json.dumps(cfg), node]) for node in readers}
        children = [writer, *kids.values()]

        def collect():
            for c in children:
                for msg in c.take():
                    if "lost" in msg:
                        lost.setdefault((msg["lost"], msg["end"]), msg)

        try:
            for k in kids.values():
                k.wait_for("attached")
            writer.wait_for("ready")
            t_loss, t_end = _under_loss(nodes, readers, losses, args, stats, rng, collect)
            early = dict(lost)
            t_cut = _partition(nodes, readers, losses, kinds, lost, collect)
        finally:
            for c in children:
                c.stop()
    _tally(readers, losses, kinds, stats, lost, early, t_loss, t_end, t_cut)


ENDS = {"idle": ("writer", "reader"), "busy": ("writer", "reader"), "link": ("engine", "rank")}  # a kind's two ends


def _under_loss(nodes, readers, losses, args, stats, rng, collect) -> tuple[float, float]:
    """Each reader node drops its share of packets for args.minutes, short cuts on top with args.short_cuts;
    returns when the loss began and ended."""
    t_loss = time.monotonic()
    for node, p in zip(readers, losses):
        if p:
            nodes.lose(node, p)
    until = t_loss + args.minutes * 60
    next_cut = {n: t_loss + rng.expovariate(1 / SHORT_CUT_EVERY_S) for n in readers}
    while time.monotonic() < until:
        collect()
        if args.short_cuts:
            for node, p in zip(readers, losses):
                if time.monotonic() >= next_cut[node] and until - time.monotonic() > 5:
                    _short_cut(nodes, node, p, stats[p], rng, t_loss)
                    next_cut[node] = time.monotonic() + max(5.0, rng.expovariate(1 / SHORT_CUT_EVERY_S))
        time.sleep(0.2)
    collect()
    return t_loss, time.monotonic()


def _short_cut(nodes, node: str, p: int, s: dict, rng, t_loss: float) -> None:
    """`node` cut for 0.3-1.0 s, then its loss put back."""
    t_cut = time.monotonic()
    nodes.cut(node)
    time.sleep(rng.uniform(0.3, 1.0))
    nodes.heal(node)
    lasted = time.monotonic() - t_cut
    if p:
        nodes.lose(node, p)
    s["cuts"] += 1
    s["longest_cut_s"] = max(s.get("longest_cut_s", 0.0), lasted)
    print(f"short cut on {node}: {t_cut - t_loss:.1f} s into the loss, lasted {lasted:.2f} s", file=sys.stderr,
          flush=True)


def _partition(nodes, readers, losses, kinds, lost, collect) -> float:
    """The loss lifted and every reader node cut off for good; returns the cut's time once both ends of every
    connection reported it, or after DETECT_WAIT_S."""
    for node, p in zip(readers, losses):
        if p:
            nodes.heal(node)
    t_cut = time.monotonic()
    for node in readers:
        nodes.cut(node)
    expected = {(c, e) for c in kinds for e in ENDS[c.split("/")[1].rstrip("0123456789")]}
    deadline = t_cut + DETECT_WAIT_S
    while time.monotonic() < deadline and not expected <= set(lost):
        collect()
        time.sleep(0.05)
    collect()
    return t_cut


def _tally(readers, losses, kinds, stats, lost, early, t_loss, t_end, t_cut) -> None:
    """Per loss level: connection minutes, connections lost during the loss, message counts, detection times."""
    for node, p in zip(readers, losses):
        s = stats[p]
        s["rounds"] += 1
        for conn in sorted(c for c in kinds if c.startswith(node + "/")):
            kind = conn.split("/")[1].rstrip("0123456789")
            s["connection_minutes"][kind] += (t_end - t_loss) / 60
            died = {e: m for (c, e), m in early.items() if c == conn}
            if died:
                t_first = min(m["t"] for m in died.values())
                print(f"{conn} lost {t_first - t_loss:.1f} s into the loss", file=sys.stderr, flush=True)
                s["false_disconnects"].append({"connection": conn, "after_s": round(t_first - t_loss, 1),
                                               "ends": {e: m["error"] for e, m in died.items()}})
            for (c, e), m in lost.items():
                if c != conn:
                    continue
                for key in ("got", "gaps", "dup", "ooo"):
                    s["messages"][key] += m.get(key, 0)
                if not died:
                    s["detect"][f"{kind} {e}"].append(m["t"] - t_cut)
            if not died:
                for e in ENDS[kind]:
                    if (conn, e) not in lost:
                        s["undetected"].append(f"{conn} {e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="under loss, per round")
    ap.add_argument("--loss", default="2,5", help="loss levels, %% each way, one reader node each (0: none)")
    ap.add_argument("--idle", type=int, default=6, help="idle queues per reader node")
    ap.add_argument("--links", type=int, default=2, help="liveness links per reader node")
    ap.add_argument("--busy-rate", type=float, default=100.0, help="messages a second on the busy queue")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--short-cuts", action="store_true", help="cut each node for 0.3-1.0 s now and then")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from hotloop.queue.remote import peer_timeout_s
    from hotloop.testing.netns import Nodes

    if (why := Nodes.unavailable()) is not None:
        sys.exit(f"loss_survival: {why}")
    losses = [int(x) for x in args.loss.split(",")]
    from collections import defaultdict

    stats = {p: {"rounds": 0, "cuts": 0, "connection_minutes": defaultdict(float), "false_disconnects": [],
                 "messages": defaultdict(int), "detect": defaultdict(list), "undetected": []} for p in losses}
    rng = random.Random(args.seed)
    for r in range(args.rounds):
        _round(args, losses, stats, rng)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ok = True
    print(f"loss_survival: {args.rounds} round(s) of {args.minutes:g} min under loss, then a partition; "
          f"HOTLOOP_PEER_TIMEOUT_S={peer_timeout_s()}; per reader node {args.idle} idle queues (a message every "
          f"{IDLE_EVERY_S:g} s), 1 at {args.busy_rate:g} msg/s, {args.links} liveness links"
          + ("; short cuts 0.3-1.0 s" if args.short_cuts else ""))
    for p, s in stats.items():
        cm = s["connection_minutes"]
        print(f"\n{p} % loss each way: connection-minutes idle {cm['idle']:.0f}, busy {cm['busy']:.0f}, "
              f"links {cm['link']:.0f}"
              + (f"; {s['cuts']} short cuts, the longest {s.get('longest_cut_s', 0):.2f} s from injecting to healed"
                 if args.short_cuts else ""))
        print(f"  live connections lost: {len(s['false_disconnects'])}")
        for fd in s["false_disconnects"]:
            print(f"    {fd['connection']} after {fd['after_s']} s: {fd['ends']}")
        m = s["messages"]
        print(f"  messages received {m['got']}, lost {m['gaps']}, duplicated {m['dup']}, out of order {m['ooo']}")
        ok &= not s["false_disconnects"] and not (m["gaps"] or m["dup"] or m["ooo"])
        print("  partition to each end's error, s:  n    p50    p99    max")
        for key, xs in sorted(s["detect"].items()):
            print(f"    {key:<28} {len(xs):>3} {percentile(xs, 50):6.2f} {percentile(xs, 99):6.2f} {max(xs):6.2f}")
            ok &= percentile(xs, 99) <= GOAL_P99_S
        if s["undetected"]:
            ok = False
            print(f"  not seen within {DETECT_WAIT_S:g} s: {', '.join(s['undetected'])}")
    print("\nverdict:", "PASS" if ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "peer_timeout_s": peer_timeout_s(), "ok": ok,
                       "stats": {str(p): s for p, s in stats.items()}}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]  # run as a file: not bench/ (its vllm/)
    if len(sys.argv) > 1 and sys.argv[1] == "_writer":
        _writer(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "_reader":
        _reader(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
