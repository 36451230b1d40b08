"""``hotloop bench queue``: hotloop.MessageQueue next to the transports engines use today, in one run.

Every peer runs between two processes (fork) on this machine:
(a) round trip: process A sends a message, B echoes it back, A waits; p50/p99 over many rounds after a warm-up,
    64 B and 64 KiB, raw bytes: multiprocessing.Pipe (send_bytes), pyzmq PAIR over ipc://, faster-fifo (pickles
    what it is given), hotloop
    (enqueue_bytes / dequeue_bytes: the reader gets its own copy; and zero-copy views, acquire_read), plus
    hotloop with pickled objects (enqueue / dequeue). faster-fifo and
    vLLM's MessageQueue join the table when they import (``pip install hotloop[bench]`` installs pyzmq and
    faster-fifo).
(b) one-way throughput of 64 B messages from Python (the reader counts them; messages/s over the reader's time).
(c) a large tensor through the queue, 5 times (256 MiB, 64 MiB with --quick): bandwidth next to a memcpy of
    the same size in this run (the queue copies twice: into the ring, then out of it).
(d) idle: a reader parked on an empty queue; its process CPU time over the wait.
(e) periodic traffic (a message every 1, 5, 20 ms with +-20 % jitter): delivery latency (timestamp in the
    message -> reader has it) p50/p99 and reader CPU, for an always-spinning reader, an always-parking one, the
    default policy and the adaptive policy.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import time

import hotloop
from hotloop import MessageQueue, WaitPolicy
from hotloop.bench.report import Progress, fmt, summarize_us, table

CTX = mp.get_context("fork")
SMALL, LARGE = 64, 64 * 1024


# ---- transports: (make_pair, send, recv) with the same shape for every peer ---------------------------------


class _Hotloop:
    name = "hotloop MessageQueue (bytes)"

    def __init__(self):
        self.ab = MessageQueue(1, max_chunk_bytes=1 << 20)
        self.ba = MessageQueue(1, max_chunk_bytes=1 << 20)

    def side_b(self):  # in the child: (recv, send)
        r = MessageQueue.create_from_handle(self.ab.export_handle(), 0)
        return r.dequeue_bytes, self.ba.enqueue_bytes

    def side_a(self):
        self.r = MessageQueue.create_from_handle(self.ba.export_handle(), 0)
        self.ab.wait_until_ready(30)
        self.ba.wait_until_ready(30)
        return self.ab.enqueue_bytes, self.r.dequeue_bytes

    def close(self):
        for q in (self.ab, self.ba, self.r):
            q.close()


class _HotloopObjects(_Hotloop):
    name = "hotloop MessageQueue (pickled objects)"

    def side_b(self):
        r = MessageQueue.create_from_handle(self.ab.export_handle(), 0)
        return r.dequeue, self.ba.enqueue

    def side_a(self):
        super().side_a()
        return self.ab.enqueue, self.r.dequeue


class _HotloopView(_Hotloop):
    name = "hotloop MessageQueue (zero-copy views)"

    @staticmethod
    def _viewer(ring):
        def recv():  # releases the previous message's view, then lends the next one (acquire_read, unrolled)
            ring.release()
            return ring.read_view(None)

        return recv

    def side_b(self):
        self.rb = MessageQueue.create_from_handle(self.ab.export_handle(), 0)  # kept open while viewing
        return self._viewer(self.rb._reader), self.ba.enqueue_bytes

    def side_a(self):
        super().side_a()
        return self.ab.enqueue_bytes, self._viewer(self.r._reader)


class _Pipe:
    name = "multiprocessing.Pipe"

    def __init__(self):
        self.a, self.b = CTX.Pipe()

    def side_b(self):
        return self.b.recv_bytes, self.b.send_bytes

    def side_a(self):
        return self.a.send_bytes, self.a.recv_bytes

    def close(self):
        self.a.close()
        self.b.close()


class _Zmq:
    name = "pyzmq PAIR ipc://"
    # copying sends: zero-copy sends use a helper thread that does not survive fork

    def __init__(self):
        self.path = f"ipc:///tmp/hotloop-bench-{os.getpid()}-{random.getrandbits(32):08x}"

    def side_b(self):
        import zmq

        self.ctx_b = zmq.Context()
        self.s_b = self.ctx_b.socket(zmq.PAIR)
        self.s_b.connect(self.path)
        return self.s_b.recv, self.s_b.send

    def finish_b(self):
        # zmq sends from its I/O thread: flush the last message before the child exits
        self.s_b.close(linger=10_000)
        self.ctx_b.term()

    def side_a(self):
        import zmq

        self.ctx = zmq.Context()  # its own, terminated in close(): no zmq context may be alive at a fork
        self.s = self.ctx.socket(zmq.PAIR)
        self.s.bind(self.path)
        return self.s.send, self.s.recv

    def close(self):
        self.s.close(linger=0)
        self.ctx.term()


class _FasterFifo:
    name = "faster-fifo Queue (pickled)"

    def __init__(self):
        import faster_fifo

        self.ab, self.ba = faster_fifo.Queue(1 << 22), faster_fifo.Queue(1 << 22)

    def side_b(self):
        return self.ab.get, self.ba.put

    def side_a(self):
        return self.ab.put, self.ba.get

    def close(self):
        self.ab.close()
        self.ba.close()


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _peers():
    peers = [_Hotloop, _HotloopView, _HotloopObjects, _Pipe]
    if _installed("zmq"):
        peers.append(_Zmq)
    if _installed("faster_fifo"):
        peers.append(_FasterFifo)
    return peers


def _report(out, value):
    """Child side: hand `value` to the parent, then exit at once (flushing the queue's feeder thread first)."""
    out.put(value)
    out.close()
    out.join_thread()
    os._exit(0)


def _echo(peer, rounds):
    recv, send = peer.side_b()
    for _ in range(rounds):
        send(recv())
    getattr(peer, "finish_b", lambda: None)()
    os._exit(0)


def _round_trip(peer_cls, size, rounds, warmup):
    peer = peer_cls()
    child = CTX.Process(target=_echo, args=(peer, rounds + warmup))
    child.start()
    send, recv = peer.side_a()
    msg = bytes(size) if "objects" not in peer.name else {"payload": bytes(size)}
    lat = []
    for i in range(rounds + warmup):
        t0 = time.perf_counter_ns()
        send(msg)
        recv()
        if i >= warmup:
            lat.append(time.perf_counter_ns() - t0)
    child.join(30)
    peer.close()
    return summarize_us(lat)


# ---- (b) throughput ------------------------------------------------------------------------------------------


def _count(peer, n, out):
    recv, _send = peer.side_b()
    recv()  # the start marker
    t0 = time.perf_counter()
    for _ in range(n):
        recv()
    _report(out, n / (time.perf_counter() - t0))


def _throughput(peer_cls, n):
    peer = peer_cls()
    out = CTX.Queue()
    child = CTX.Process(target=_count, args=(peer, n, out))
    child.start()
    send, _recv = peer.side_a()
    msg = bytes(SMALL) if "objects" not in peer.name else {"payload": bytes(SMALL)}
    send(msg)
    for _ in range(n):
        send(msg)
    rate = out.get(timeout=120)
    child.join(30)
    peer.close()
    return rate


# ---- (c) large tensor ----------------------------------------------------------------------------------------


def _receive_big(handle, count, out):
    r = MessageQueue.create_from_handle(handle, 0)
    for i in range(count):
        obj = r.dequeue(timeout=120)
        done = time.perf_counter()
        nbytes = memoryview(obj).nbytes if not hasattr(obj, "nbytes") else int(obj.nbytes)
        del obj  # frees the buffer for the next message (kept warm by the reader)
        if i + 1 < count:
            out.put((done, nbytes))
    _report(out, (done, nbytes))


def _memcpy_gbps(nbytes):
    """The machine's copy bandwidth for `nbytes` (best of 3, destination already faulted in)."""
    src, dst = bytearray(b"\x01") * nbytes, bytearray(nbytes)
    dst[:] = src
    best = min(_timed(lambda: dst.__setitem__(slice(None), src)) for _ in range(3))
    return nbytes / best / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _big_message(nbytes, count=5):
    memcpy_gbs = _memcpy_gbps(nbytes)
    try:
        import torch

        payload = torch.ones(nbytes // 4, dtype=torch.float32)
        kind = "torch tensor"
    except ImportError:
        payload, kind = pickle.PickleBuffer(bytearray(nbytes)), "buffer (torch not installed)"
    q = MessageQueue(1, max_chunk_bytes=16 << 20)
    out = CTX.Queue()
    child = CTX.Process(target=_receive_big, args=(q.export_handle(), count, out))
    child.start()
    q.wait_until_ready(30)
    rates = []
    for _ in range(count):
        t0 = time.perf_counter()
        q.enqueue(payload, timeout=120)
        t_done, got = out.get(timeout=120)
        rates.append(got / (t_done - t0) / 1e9)
    child.join(30)
    q.close()
    steady = sorted(rates[1:])[len(rates[1:]) // 2]
    return {"bytes": nbytes, "kind": kind, "memcpy_GBps": memcpy_gbs, "first_GBps": rates[0],
            "steady_GBps": steady, "pct_of_memcpy": 100 * steady / memcpy_gbs}


# ---- (d) idle, (e) periodic ----------------------------------------------------------------------------------


def _idle_reader(handle, seconds, out):
    r = MessageQueue.create_from_handle(handle, 0)
    c0, t0 = time.process_time(), time.monotonic()
    try:
        r.dequeue(timeout=seconds)
    except TimeoutError:
        pass
    _report(out, 100 * (time.process_time() - c0) / (time.monotonic() - t0))


def _idle(seconds):
    q = MessageQueue(1)
    out = CTX.Queue()
    child = CTX.Process(target=_idle_reader, args=(q.export_handle(), seconds, out))
    child.start()
    pct = out.get(timeout=seconds + 30)
    child.join(30)
    q.close()
    return pct


POLICIES = {
    "always spin": dict(spin_us=10_000_000, yield_us=0),
    "always park": dict(spin_us=0, yield_us=0),
    "default (spin 20 us, yield 10 us)": dict(),
    "adaptive": dict(adaptive=True),
}


def _periodic_reader(handle, policy_kwargs, n, out):
    r = MessageQueue.create_from_handle(handle, 0, policy=WaitPolicy(**policy_kwargs))
    lat = []
    c0, t0 = time.process_time(), time.monotonic()
    for _ in range(n):
        sent = int.from_bytes(r.dequeue_bytes(timeout=30)[:8], "little")
        lat.append(time.monotonic_ns() - sent)
    _report(out, (lat, 100 * (time.process_time() - c0) / (time.monotonic() - t0)))


def _periodic(period_s, policy_kwargs, n):
    q = MessageQueue(1)
    out = CTX.Queue()
    child = CTX.Process(target=_periodic_reader, args=(q.export_handle(), policy_kwargs, n, out))
    child.start()
    q.wait_until_ready(30)
    rng = random.Random(7)
    for _ in range(n):
        time.sleep(period_s * rng.uniform(0.8, 1.2))
        q.enqueue_bytes(time.monotonic_ns().to_bytes(8, "little") + bytes(56))
    lat, cpu = out.get(timeout=120)
    child.join(30)
    q.close()
    return {"latency": summarize_us(lat), "reader_cpu_pct": cpu}


# ---- run -----------------------------------------------------------------------------------------------------


def run(quick: bool = False):
    rounds, warmup = (2000, 200) if quick else (20000, 2000)
    n_through = 50_000 if quick else 500_000
    big = (64 if quick else 256) << 20
    idle_s = 1.0 if quick else 5.0
    periodic_n = 60 if quick else 400
    periods = (0.001, 0.005, 0.020)
    peers = _peers()
    progress = Progress("bench queue", 2 * len(peers) + len(peers) + 2 + len(periods) * len(POLICIES))
    rt = {}
    for peer in peers:
        for size in (SMALL, LARGE):
            progress.step(f"round trip {peer.name} {size} B")
            rt[(peer.name, size)] = _round_trip(peer, size, rounds, warmup)
    thr = {}
    for peer in peers:
        progress.step(f"throughput {peer.name}")
        thr[peer.name] = _throughput(peer, n_through)
    progress.step("large message")
    bigr = _big_message(big)
    progress.step("idle reader")
    idle_pct = _idle(idle_s)
    per = {}
    for period in periods:
        for pname, kw in POLICIES.items():
            progress.step(f"periodic {period * 1e3:.0f} ms {pname}")
            per[(period, pname)] = _periodic(period, kw, periodic_n)
    progress.close()

    ref = rt[(_Hotloop.name, SMALL)]["p50_us"]
    rows = []
    for peer in peers:
        s, l_ = rt[(peer.name, SMALL)], rt[(peer.name, LARGE)]
        rows.append([peer.name, fmt(s["p50_us"]), fmt(s["p99_us"]), fmt(l_["p50_us"]), fmt(l_["p99_us"]),
                     fmt(s["p50_us"] / ref, 2), fmt(thr[peer.name] / 1e6, 2)])
    text = table(
        f"(a) round trip between two processes, us ({rounds} rounds after {warmup} warm-up), (b) one-way "
        f"throughput of 64 B messages ({n_through} messages)",
        ["transport", "64B p50", "p99", "64KiB p50", "p99", "64B p50 vs hotloop", "M msg/s"],
        rows,
        note="Not measured: vLLM's MessageQueue (not installed)"
        + ("" if _installed("faster_fifo") else ", faster-fifo (not installed: pip install hotloop[bench])")
        + ("" if _installed("zmq") else ", pyzmq (not installed)") + ".",
    )
    text += "\n\n" + table(
        f"(c) a {bigr['bytes'] >> 20} MiB {bigr['kind']} through the queue, 5 times",
        ["first GB/s", "then (median) GB/s", "memcpy GB/s", "% of memcpy"],
        [[fmt(bigr["first_GBps"], 2), fmt(bigr["steady_GBps"], 2), fmt(bigr["memcpy_GBps"], 2),
          fmt(bigr["pct_of_memcpy"])]],
        note="enqueue start -> reader has the tensor: two copies (into the ring, out of it, pipelined by record). "
        "The first transfer also pays for the reader's fresh memory (page faults); later ones reuse it.",
    )
    text += "\n\n" + table(
        f"(d) a reader parked {idle_s:.0f} s on an empty queue", ["reader CPU % of a core"], [[fmt(idle_pct, 3)]])
    prow = []
    for period in periods:
        spin_cpu = per[(period, "always spin")]["reader_cpu_pct"]
        spin_p50 = per[(period, "always spin")]["latency"]["p50_us"]
        for pname in POLICIES:
            r = per[(period, pname)]
            prow.append([f"{period * 1e3:.0f} ms", pname, fmt(r["latency"]["p50_us"]), fmt(r["latency"]["p99_us"]),
                         fmt(r["latency"]["p50_us"] / spin_p50, 2), fmt(r["reader_cpu_pct"]),
                         fmt(100 * r["reader_cpu_pct"] / spin_cpu if spin_cpu else float("nan"))])
    text += "\n\n" + table(
        f"(e) periodic traffic ({periodic_n} messages of 64 B per row, +-20 % jitter): delivery latency, us",
        ["period", "reader policy", "p50", "p99", "p50 vs spin", "reader CPU %", "% of spin's CPU"],
        prow,
        note="Goal: the adaptive/default reader within 2x of the spinning reader's p50 at <= 25 % of its CPU.",
    )
    data = {
        "round_trip_us": {f"{k[0]} {k[1]}B": v for k, v in rt.items()},
        "throughput_msgs_per_s": thr,
        "large_message": bigr,
        "idle_reader_cpu_pct": idle_pct,
        "periodic": {f"{k[0] * 1e3:.0f}ms {k[1]}": v for k, v in per.items()},
    }
    return data, text
