"""64-byte round trip between two processes: MessageQueue with a shared-memory reader, MessageQueue with a remote
(TCP loopback, CurveZMQ) reader, and plain pyzmq PUB/SUB over TCP loopback with blocking receives, without and with
CURVE (the baselines: what the transport costs, and what its encryption costs), in one run.
``hotloop bench queue`` runs the same comparison over alternating runs (its table (r)).

    python -m hotloop.bench.remote_round_trip [rounds] [--reps N] [--hops] [--busy N]

Method: one process sends 64 B and waits for the echo from a second process (spawned), `rounds` times after
rounds/10 of warm-up; per configuration the median (p50) and p99 of those round trips. A repetition runs every
configuration once, each with fresh processes and sockets, in an order that rotates between repetitions (a
machine whose load drifts favours none of them); the summary gives, per configuration, the median over
repetitions of p50 and of p99 with [min-max], and the remote reader's p50 over each baseline's p50 *of the same
repetition*, median [min-max], for p50 and p99. --busy N runs it all beside N processes spinning in Python (a
loaded host: the soaks' load check uses two). Scheduling on a small shared machine moves single runs by 2x: read the ranges.

--hops: the remote reader's round trip cut into hops by time stamps (perf_counter_ns: CLOCK_MONOTONIC, one clock
for both processes): the writer's enqueue, the flight to the echo's wake-up (ZeroMQ's I/O threads, TCP, CURVE,
the wake-up of the reader's thread from wait_any), the echo's read after it woke, its enqueue, the flight back
and the read; and the same for CURVE PUB/SUB (send, flight to the return of the blocking recv), medians in us.
"""

import argparse
import multiprocessing as mp
import statistics
import time

import zmq

from hotloop import MessageQueue

CTX = mp.get_context("spawn")
ns = time.perf_counter_ns
MESSAGE = b"x" * 64


def _stamp_wake_ups(stamps: list) -> None:
    """Record in `stamps` when each wait of this process's remote readers returns (the --hops breakdown), where the
    wait is a Python call to hook. The remote reader waits inside its C++ read (_core.ZmqReader) now, so nothing
    is recorded and the wake-up hop is folded into the flight: "echo's read" and "read" then read 0."""
    import hotloop.queue.remote.subscriber as subscriber
    wait_any = getattr(subscriber, "wait_any", None)
    if wait_any is None:
        return

    def stamped(*args, **kwargs):
        ready = wait_any(*args, **kwargs)
        stamps.append(ns())
        return ready

    subscriber.wait_any = stamped


def _mq_echo(handle, conn, n_local, hops):
    r = MessageQueue.create_from_handle(handle, 0)
    back = MessageQueue(1, n_local_reader=n_local, connect_ip="127.0.0.1")
    conn.send(back.export_handle())
    back.wait_until_ready(30)
    wakes, times = [], []
    if hops:
        _stamp_wake_ups(wakes)
    while True:
        wakes.clear()
        try:
            m = r.dequeue_bytes(timeout=30)
        except Exception:
            break
        t_read = ns()
        back.enqueue_bytes(m)
        if hops:
            times.append((wakes[-1] if wakes else t_read, t_read, ns()))
    conn.send(times)
    back.close()


def _curve(pub, sub, server_public, server_secret):
    """CURVE on both sockets (no ZAP handler: hotloop's runs once per connection, not per message)."""
    pub.curve_server, pub.curve_publickey, pub.curve_secretkey = True, server_public, server_secret
    sub.curve_serverkey = server_public
    sub.curve_publickey, sub.curve_secretkey = zmq.curve_keypair()


def _zmq_echo(port, conn, keys, hops):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    pub = ctx.socket(zmq.PUB)
    if keys:  # one key pair for both directions: the floor measures the cipher, not key management
        _curve(pub, sub, *keys)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    conn.send(pub.bind_to_random_port("tcp://127.0.0.1"))
    times = []
    while (m := sub.recv()) != b"stop":
        t_read = ns()
        pub.send(m)
        if hops:
            times.append((t_read, t_read, ns()))
    conn.send(times)


def _measure(send, recv, rounds, wakes=None):
    """Round trips (ns) after rounds/10 of warm-up; with `wakes`, also (start, sent, woken, read) of each."""
    lat, stamps = [], []
    for i in range(rounds + rounds // 10):
        if wakes is not None:
            wakes.clear()
        t = ns()
        send(MESSAGE)
        t_sent = ns()
        recv()
        t_read = ns()
        lat.append(t_read - t)
        stamps.append((t, t_sent, wakes[-1] if wakes else t_read, t_read))
    return lat[rounds // 10:], stamps[rounds // 10:]


def _hops(stamps, echo_times):
    """Median of each hop (us) over the rounds both sides recorded (None if the echo recorded none)."""
    if not echo_times:
        return None
    echo_times = echo_times[-len(stamps):]
    rows = [(t1 - t0, e0 - t1, e1 - e0, e2 - e1, w - e2, t2 - w, t2 - t0)
            for (t0, t1, w, t2), (e0, e1, e2) in zip(stamps, echo_times)]
    names = ("enqueue", "flight to echo's wake-up", "echo's read", "echo's enqueue", "flight back to wake-up",
             "read", "round trip")
    return {name: statistics.median(r[i] for r in rows) / 1e3 for i, name in enumerate(names)}


def _mq_round_trip(n_local, rounds, hops=False):
    ab = MessageQueue(1, n_local_reader=n_local, connect_ip="127.0.0.1")
    a, b = CTX.Pipe()
    p = CTX.Process(target=_mq_echo, args=(ab.export_handle(), b, n_local, hops))
    p.start()
    back = MessageQueue.create_from_handle(a.recv(), 0)
    ab.wait_until_ready(30)
    wakes = [] if hops else None
    if hops:
        _stamp_wake_ups(wakes)
    lat, stamps = _measure(ab.enqueue_bytes, lambda: back.dequeue_bytes(timeout=10), rounds, wakes)
    ab.shutdown()
    echo_times = a.recv() if a.poll(30) else []  # an echo that died sends nothing
    p.join(10)
    ab.close()
    back.close()
    return lat, (_hops(stamps, echo_times) if hops else None)


def _zmq_round_trip(keys, rounds, hops=False):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    sub = ctx.socket(zmq.SUB)
    if keys:
        _curve(pub, sub, *keys)
    a, b = CTX.Pipe()
    p = CTX.Process(target=_zmq_echo, args=(pub.bind_to_random_port("tcp://127.0.0.1"), b, keys, hops))
    p.start()
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{a.recv()}")
    while True:  # PUB/SUB joins late: send until the echo answers
        pub.send(b"x")
        if sub.poll(100):
            sub.recv()
            break
    while sub.poll(100):
        sub.recv()
    lat, stamps = _measure(pub.send, sub.recv, rounds)
    pub.send(b"stop")
    echo_times = a.recv() if a.poll(30) else []  # an echo that died sends nothing
    p.join(10)
    ctx.destroy(0)
    return lat, (_hops(stamps, echo_times[-len(stamps):]) if hops else None)


CONFIGS = (
    ("MessageQueue, shared-memory reader", lambda rounds, hops: _mq_round_trip(1, rounds)),
    ("MessageQueue, remote reader (TCP)", lambda rounds, hops: _mq_round_trip(0, rounds, hops)),
    ("pyzmq PUB/SUB (TCP), blocking recv", lambda rounds, hops: _zmq_round_trip(None, rounds)),
    ("pyzmq PUB/SUB (TCP, CURVE), blocking recv",
     lambda rounds, hops: _zmq_round_trip(zmq.curve_keypair(), rounds, hops)),
)
REMOTE, PLAIN, CURVE = CONFIGS[1][0], CONFIGS[2][0], CONFIGS[3][0]


def _spread(values, fmt="{:.1f}"):
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _busy():
    while True:
        pass


def main(rounds: int = 5000, reps: int = 5, hops: bool = False, busy: int = 0):
    """`busy`: that many processes spinning in Python at normal priority for the whole run (a loaded host, as
    scripts/load_check.sh loads the soaks)."""
    spinners = [CTX.Process(target=_busy, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        _run(rounds, reps, hops, busy)
    finally:
        for p in spinners:
            p.kill()
            p.join()


def _run(rounds: int, reps: int, hops: bool, busy: int):
    p50 = {name: [] for name, _ in CONFIGS}
    p99 = {name: [] for name, _ in CONFIGS}
    breakdown = {name: [] for name, _ in CONFIGS}
    for rep in range(reps):
        order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)]
        for name, run in order:
            lat, cut = run(rounds, hops)
            lat.sort()
            p50[name].append(lat[len(lat) // 2] / 1e3)
            p99[name].append(lat[int(len(lat) * 0.99)] / 1e3)
            if cut:
                breakdown[name].append(cut)
    print(f"64 B round trip between two processes: {rounds} rounds per run, {reps} repetitions, configurations in "
          "rotating order" + (f", beside {busy} busy process{'es' * (busy > 1)}" if busy else "")
          + "; median over repetitions [min-max], us")
    for name, _ in CONFIGS:
        print(f"  {name:44s} p50 {_spread(p50[name]):22s} p99 {_spread(p99[name])}")
    for base in (PLAIN, CURVE):
        ratios = [r / b for r, b in zip(p50[REMOTE], p50[base])]
        print(f"  remote reader p50 / {base} p50 (same repetition): {_spread(ratios, '{:.2f}')}")
        ratios = [r / b for r, b in zip(p99[REMOTE], p99[base])]
        print(f"  remote reader p99 / {base} p99 (same repetition): {_spread(ratios, '{:.2f}')}")
    for name, cuts in breakdown.items():
        if cuts:
            print(f"  hops of {name} (median over repetitions of each hop's median, us):")
            for hop in cuts[0]:
                print(f"    {hop:28s} {_spread([c[hop] for c in cuts])}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", nargs="?", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every configuration (default 5)")
    parser.add_argument("--hops", action="store_true", help="also cut the remote round trips into hops")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the run (a loaded host; "
                        "scripts/load_check.sh uses 2)")
    args = parser.parse_args()
    main(args.rounds, args.reps, args.hops, args.busy)
