"""``hotloop bench queue``: hotloop.MessageQueue next to its floors and the transports engines use today, in one run.

Every peer runs between two processes (fork) on this machine. Every figure of (a), (b) and (r) is the median over
``runs`` (default 5) runs that alternate between the peers (run 1 of every peer, then run 2 of every peer, ...),
and each row is shown next to its floor from the same run, as a ratio:
(a) round trip: process A sends a message, B echoes it back, A waits; p50/p99/p99.9 over many rounds after a
    warm-up, 64 B and 64 KiB. hotloop's bytes path (enqueue_bytes / dequeue_bytes: the reader gets its own copy)
    against a pure-Python shared-memory spin ring (``spin_ring.py``); hotloop's object path (enqueue / dequeue of
    ``{"payload": bytes(n)}``) and zero-copy views (acquire_read) against the bytes path; vLLM's MessageQueue
    (objects, when vLLM imports) against hotloop's object path; multiprocessing.Pipe (send_bytes), pyzmq PAIR
    over ipc:// and faster-fifo (pickles what it is given) against the bytes path.
(b) one-way throughput of 64 B messages from Python (the reader counts them; messages/s over the reader's time),
    with the same floors.
(r) remote: a 64 B round trip through MessageQueue with a remote reader on each side (TCP loopback, CurveZMQ)
    against plain pyzmq PUB/SUB over the same transport, once without CURVE and once with CURVE (no ZAP handler:
    hotloop's runs once per connection, not per message): the first ratio is what the network path costs in
    all, the second what hotloop's own layers cost beyond the encryption.
(c) a large tensor through the queue, 5 times (64 MiB; 256 MiB with --full): bandwidth next to a memcpy of
    the same size in this run (the queue copies twice: into the ring, then out of it).
(d) idle: a reader parked on an empty queue; its process CPU time over the wait.
(e) periodic traffic (a message every 1, 5, 20 ms with +-20 % jitter, and every 1.4 and 0.5 ms +-10 %: GPU decode
    steps): delivery latency (timestamp in the message -> reader has it) p50/p99 and reader CPU, for an
    always-spinning reader, an always-parking one, the default policy, the adaptive policy and the paced policy (it
    learns the period, parks on a timer until shortly before the next message and spins through it;
    wait_policy.h); twice: unpinned (the scheduler may run writer and reader on one CPU, as on this 2-vCPU machine)
    and pinned (reader and writer on two different CPUs: a GPU host with cores to spare).
    ``python -m hotloop.bench.queue_bench --only periodic [--pin]`` runs this section alone (``--help``).
(f) remote readers on two nodes, direct or through each node's relay (``relay_bench.py``): the writer's
    throughput to k = 1, 2, 4, 8 remote ranks, and a 64 B round trip to a relayed rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import time

from hotloop import MessageQueue, WaitPolicy
from hotloop.bench import relay_bench
from hotloop.bench.report import Goal, Progress, Report, check_goals, fmt, median, percentile, summarize_us, table
from hotloop.bench.spin_ring import SpinRing

CTX = mp.get_context("fork")
SMALL, LARGE = 64, 64 * 1024
LOOPBACK = "127.0.0.1"


# ---- transports: (make_pair, send, recv) with the same shape for every peer ---------------------------------
# Each peer has `floor`: the name of the row it is measured against (None for a floor itself), and `objects`:
# whether it sends Python objects ({"payload": bytes(n)}) instead of raw bytes.


class _Hotloop:
    name = "hotloop MessageQueue (bytes)"
    floor = "pure-Python shm spin ring"
    objects = False

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
    name = "hotloop MessageQueue (objects)"
    floor = _Hotloop.name
    objects = True

    def side_b(self):
        r = MessageQueue.create_from_handle(self.ab.export_handle(), 0)
        return r.dequeue, self.ba.enqueue

    def side_a(self):
        super().side_a()
        return self.ab.enqueue, self.r.dequeue


class _PickleOverBytes(_Hotloop):
    """The object path's own floor: pickle.dumps then the bytes path, the bytes path then pickle.loads."""

    name = "bytes path + pickle.dumps/loads"
    floor = _Hotloop.name
    objects = True

    @staticmethod
    def _ends(reader, writer):
        dumps, loads, enqueue, dequeue = pickle.dumps, pickle.loads, writer.enqueue_bytes, reader.dequeue_bytes
        return (lambda: loads(dequeue())), (lambda obj: enqueue(dumps(obj, 5)))

    def side_b(self):
        return self._ends(MessageQueue.create_from_handle(self.ab.export_handle(), 0), self.ba)

    def side_a(self):
        super().side_a()
        recv, send = self._ends(self.r, self.ab)
        return send, recv


class _HotloopView(_Hotloop):
    name = "hotloop MessageQueue (zero-copy views)"
    floor = _Hotloop.name

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


class _SpinRing:
    name = "pure-Python shm spin ring"
    floor = None
    objects = False

    def __init__(self):
        self.ab, self.ba = SpinRing(), SpinRing()

    def side_b(self):
        return self.ab.recv, self.ba.send

    def side_a(self):
        return self.ab.send, self.ba.recv

    def close(self):
        self.ab.close()
        self.ba.close()


class _Pipe:
    name = "multiprocessing.Pipe"
    floor = _Hotloop.name
    objects = False

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
    floor = _Hotloop.name
    objects = False
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
    floor = _Hotloop.name
    objects = False

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


class _AfterFork:
    """A pair of queues made after the fork (queues with sockets or threads must not exist at a fork): A makes
    the A->B writer and sends its handle; B attaches, makes the B->A writer and sends that handle back; then
    both run the queue's own readiness handshake. Subclasses say how to make, attach, ready and use a queue."""

    def __init__(self):
        self.a, self.b = CTX.Pipe()

    def side_b(self):
        self.rb = self.attach(self.b.recv())
        self.wb = self.make_writer()
        self.b.send(self.wb.export_handle())
        self.ready(self.rb, self.wb)
        return self.receiver(self.rb), self.sender(self.wb)

    def finish_b(self):  # the last echo may still be in a socket's send buffer: close flushes it
        self.wb.close()
        self.rb.close()

    def side_a(self):
        self.wa = self.make_writer()
        self.a.send(self.wa.export_handle())
        self.ra = self.attach(self.a.recv())
        self.ready(self.ra, self.wa)
        return self.sender(self.wa), self.receiver(self.ra)

    def close(self):
        self.wa.close()
        self.ra.close()
        self.a.close()
        self.b.close()

    @staticmethod
    def ready(reader, writer):
        writer.wait_until_ready(30)


class _HotloopRemote(_AfterFork):
    name = "hotloop MessageQueue, remote readers (TCP loopback, CURVE)"
    floor = "pyzmq PUB/SUB (TCP loopback, no CURVE)"
    objects = False

    @staticmethod
    def make_writer():
        return MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK)

    @staticmethod
    def attach(handle):
        return MessageQueue.create_from_handle(handle, 0)

    @staticmethod
    def sender(q):
        return q.enqueue_bytes

    @staticmethod
    def receiver(q):
        return q.dequeue_bytes


class _VllmQueue(_AfterFork):
    """vLLM's own MessageQueue (shared memory; its wait_until_ready is a collective: both sides call it)."""

    name = "vLLM MessageQueue (objects)"
    floor = _HotloopObjects.name
    objects = True
    queue_class = None  # vLLM's class; a test may put a class with the same calls here

    def make_writer(self):
        return self._class()(1, 1, max_chunk_bytes=1 << 20)

    def attach(self, handle):
        return self._class().create_from_handle(handle, 0)

    def _class(self):
        if self.queue_class is None:
            from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as queue_class

            return queue_class
        return self.queue_class

    @staticmethod
    def ready(reader, writer):
        writer.wait_until_ready()
        reader.wait_until_ready()

    @staticmethod
    def sender(q):
        return q.enqueue

    @staticmethod
    def receiver(q):
        return q.dequeue

    def finish_b(self):
        """Shared memory: nothing in flight. The child ends in os._exit, which runs no finalizer, so its queues are
        dropped here: the writer's segment is unlinked by vLLM's own finalizer (left to exit, each run's segment
        stayed in /dev/shm until the parent's resource tracker removed it, "leaked shared_memory objects")."""
        import gc

        self.wb = self.rb = None
        gc.collect()

    def close(self):  # vLLM's queue has no close(): dropping the writer unlinks its segment
        self.wa = self.ra = None
        self.a.close()
        self.b.close()


class _PubSub:
    """Plain pyzmq PUB/SUB over TCP loopback, each side publishing to the other (the remote path's floor). XPUB
    in place of PUB only to see the subscriber arrive before the first message; the data path is PUB's."""

    name = "pyzmq PUB/SUB (TCP loopback, no CURVE)"
    floor = None
    objects = False
    curve = False

    def __init__(self):
        self.a, self.b = CTX.Pipe()

    def _socket_pair(self, pipe, first: bool):
        import zmq

        self.ctx = zmq.Context()  # made after the fork, terminated before this side ends
        pub, sub = self.ctx.socket(zmq.XPUB), self.ctx.socket(zmq.SUB)
        server_public = None
        if self.curve:
            server_public, secret = zmq.curve_keypair()
            pub.curve_server, pub.curve_secretkey, pub.curve_publickey = True, secret, server_public
        port = pub.bind_to_random_port(f"tcp://{LOOPBACK}")
        if first:
            pipe.send((port, server_public))
            peer_port, peer_public = pipe.recv()
        else:
            peer_port, peer_public = pipe.recv()
            pipe.send((port, server_public))
        if self.curve:
            sub.curve_serverkey = peer_public
            sub.curve_publickey, sub.curve_secretkey = zmq.curve_keypair()
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{LOOPBACK}:{peer_port}")
        pub.recv()  # the peer's subscription: from now on nothing sent is lost
        self.pub, self.sub = pub, sub
        return pub.send, sub.recv

    def side_b(self):
        send, recv = self._socket_pair(self.b, first=False)
        return recv, send

    def finish_b(self):
        self.pub.close(linger=10_000)
        self.sub.close(linger=0)
        self.ctx.term()

    def side_a(self):
        return self._socket_pair(self.a, first=True)

    def close(self):
        self.pub.close(linger=0)
        self.sub.close(linger=0)
        self.ctx.term()
        self.a.close()
        self.b.close()


class _PubSubCurve(_PubSub):
    name = "pyzmq PUB/SUB (TCP loopback, CURVE)"
    curve = True


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _peers():
    """The peers of (a) and (b), floors first."""
    peers = [_SpinRing, _Hotloop, _HotloopObjects, _PickleOverBytes, _HotloopView, _Pipe]
    if _installed("zmq"):
        peers.append(_Zmq)
    if _installed("faster_fifo"):
        peers.append(_FasterFifo)
    if _installed("vllm"):
        peers.append(_VllmQueue)
    return peers


def _remote_peers():
    return [_PubSub, _PubSubCurve, _HotloopRemote]


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
    del recv, send  # the queues go with the peer's finish_b
    getattr(peer, "finish_b", lambda: None)()
    os._exit(0)


def _round_trip(peer_cls, size, rounds, warmup):
    peer = peer_cls()
    child = CTX.Process(target=_echo, args=(peer, rounds + warmup))
    child.start()
    send, recv = peer.side_a()
    msg = {"payload": bytes(size)} if peer.objects else bytes(size)
    lat = []
    for i in range(rounds + warmup):
        t0 = time.perf_counter_ns()
        send(msg)
        recv()
        if i >= warmup:
            lat.append(time.perf_counter_ns() - t0)
    child.join(30)
    peer.close()
    return {"p50_us": percentile(lat, 50) / 1e3, "p99_us": percentile(lat, 99) / 1e3,
            "p99.9_us": percentile(lat, 99.9) / 1e3}


def _medians(runs: list[dict]) -> dict:
    """The median of each figure over the runs (with the runs themselves, for the JSON)."""
    return {**{k: median([r[k] for r in runs]) for k in runs[0]}, "runs": runs}


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
    msg = {"payload": bytes(SMALL)} if peer.objects else bytes(SMALL)
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


ZMQ_ROW = "pyzmq ROUTER -> DEALER ipc://, blocking poll"
POLICIES = {
    "always spin": dict(spin_us=10_000_000, yield_us=0),
    "always park": dict(spin_us=0, yield_us=0),
    "default (spin 20 us, yield 10 us)": dict(),
    "adaptive": dict(adaptive=True),
    "paced": dict(paced=True),
    # not hotloop's reader: a pyzmq DEALER blocked in a poll, as vLLM's engine core reads its front end's requests
    ZMQ_ROW: None,
}
# (period s, jitter): a message every period * uniform(1 - jitter, 1 + jitter). 1.4 ms +-10 %: a GPU host's decode
# step (the worker reads the step broadcast, the engine core the answer, every ~1.4 ms); 0.5 ms +-10 %: a short
# decode step (a small model, or one of async scheduling's two broadcasts a step).
PERIODS = ((0.0005, 0.1), (0.001, 0.2), (0.0014, 0.1), (0.005, 0.2), (0.020, 0.2))
# the cadences of the paced reader's goals: unpinned (this machine's scheduler may put the writer on the reader's
# CPU) and pinned (a host with cores to spare)
PACED_GOAL_PERIODS = {"periodic": ("1ms", "1.4ms"), "periodic_pinned": ("0.5ms", "1.4ms")}


def _periodic_reader(handle, policy_kwargs, n, out, cpu=None):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    r = MessageQueue.create_from_handle(handle, 0, policy=WaitPolicy(**policy_kwargs))
    lat = []
    c0, t0 = time.process_time(), time.monotonic()
    for _ in range(n):
        sent = int.from_bytes(r.dequeue_bytes(timeout=30)[:8], "little")
        lat.append(time.monotonic_ns() - sent)
    cpu = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
    _report(out, (lat, cpu, r._policy.paced_stats() if r._policy.paced else None))


def _periodic_zmq_reader(addr, n, out, cpu=None):
    """vLLM's engine-core input thread's read: a DEALER (its own context, so its own I/O thread) blocked in a poll."""
    import zmq

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"reader")
    s.connect(addr)
    s.send(b"ready")  # the ROUTER can address it from now on
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    lat = []
    c0, t0 = time.process_time(), time.monotonic()
    for _ in range(n):
        poller.poll()
        sent = int.from_bytes(s.recv(copy=False).buffer[:8], "little")
        lat.append(time.monotonic_ns() - sent)
    cpu = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
    s.close(0)
    ctx.term()
    _report(out, (lat, cpu, None))


def _periodic_zmq(period_s, jitter, n, pin=False):
    """The periodic run with vLLM's front end -> engine core transport: a ROUTER bound on ipc:// sends to a DEALER
    blocked in a poll in another process (both with their own context, so each side's I/O thread carries it)."""
    import tempfile

    import zmq

    cpus = sorted(os.sched_getaffinity(0))
    pin = pin and len(cpus) >= 2
    addr = f"ipc://{tempfile.gettempdir()}/hotloop-periodic-{os.getpid()}-{random.getrandbits(32):08x}"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(addr)
    out = CTX.Queue()
    child = CTX.Process(target=_periodic_zmq_reader, args=(addr, n, out, cpus[0] if pin else None))
    child.start()
    rng = random.Random(7)
    try:
        if not router.poll(30_000):
            raise RuntimeError(f"the ZeroMQ reader (pid {child.pid}) did not connect within 30 s "
                               f"(exit code {child.exitcode})")
        identity, _ = router.recv_multipart()
        if pin:
            os.sched_setaffinity(0, {cpus[1]})
        for _ in range(n):
            time.sleep(period_s * rng.uniform(1 - jitter, 1 + jitter))
            router.send_multipart([identity, time.monotonic_ns().to_bytes(8, "little") + bytes(56)])
        lat, cpu, _ = out.get(timeout=120)
    finally:
        if pin:
            os.sched_setaffinity(0, cpus)
        child.join(30)
        router.close(0)
        ctx.term()
    return {"latency": summarize_us(lat), "reader_cpu_pct": cpu}


def _periodic(period_s, jitter, policy_kwargs, n, pin=False):
    """pin: the reader on the first CPU this process may use, the writer on the second (as on a host with cores to
    spare, where the two never share one). policy_kwargs None: vLLM's ZeroMQ read instead (_periodic_zmq)."""
    if policy_kwargs is None:
        return _periodic_zmq(period_s, jitter, n, pin)
    cpus = sorted(os.sched_getaffinity(0))
    pin = pin and len(cpus) >= 2
    q = MessageQueue(1)
    out = CTX.Queue()
    child = CTX.Process(target=_periodic_reader,
                        args=(q.export_handle(), policy_kwargs, n, out, cpus[0] if pin else None))
    child.start()
    q.wait_until_ready(30)
    rng = random.Random(7)
    if pin:
        os.sched_setaffinity(0, {cpus[1]})
    try:
        for _ in range(n):
            time.sleep(period_s * rng.uniform(1 - jitter, 1 + jitter))
            q.enqueue_bytes(time.monotonic_ns().to_bytes(8, "little") + bytes(56))
    finally:
        if pin:
            os.sched_setaffinity(0, cpus)
    lat, cpu, paced = out.get(timeout=120)
    child.join(30)
    q.close()
    res = {"latency": summarize_us(lat), "reader_cpu_pct": cpu}
    if paced is not None:
        res["paced"] = paced
    return res


def _period_key(period_s: float) -> str:
    return f"{period_s * 1e3:g}ms"


def periodic(quick: bool = False, runs: int = 1, progress=None, periods=PERIODS, policies=None, pin: bool = False):
    """Section (e) alone: {(period, policy): result} (the median over `runs` alternating runs of each figure) and
    its table. pin: reader and writer on two different CPUs (see _periodic)."""
    policies = policies or list(POLICIES)
    n = 60 if quick else 400
    per_runs = {(p, name): [] for p, _ in periods for name in policies}
    for i in range(runs):  # alternating, as (a): drift in the machine's load hits every policy alike
        for period, jitter in periods:
            for name in policies:
                if progress:
                    progress.step(f"periodic {period * 1e3:g} ms {name} ({i + 1}/{runs})")
                per_runs[(period, name)].append(_periodic(period, jitter, POLICIES[name], n, pin))
    per = {k: _periodic_median(v) for k, v in per_runs.items()}
    prow = []
    for period, jitter in periods:
        spin = per.get((period, "always spin"))
        for name in policies:
            r = per[(period, name)]
            lat, cpu = r["latency"], r["reader_cpu_pct"]
            ps = r.get("paced")
            prow.append([f"{period * 1e3:g} ms +-{jitter * 100:.0f} %", name, fmt(lat["p50_us"]), fmt(lat["p99_us"]),
                         fmt(lat["p50_us"] / spin["latency"]["p50_us"], 2) if spin else "-", fmt(cpu),
                         fmt(100 * cpu / spin["reader_cpu_pct"]) if spin and spin["reader_cpu_pct"] else "-",
                         f"{ps['hit']}/{ps['early']}/{ps['late']} of {ps['predicted']}" if ps else "-"])
    t = table(
        f"(e) periodic traffic ({n} messages of 64 B per row; median of {runs} alternating run(s)"
        f"{'; reader and writer pinned to two CPUs' if pin else '; unpinned'}): delivery latency, us",
        ["period", "reader policy", "p50", "p99", "p50 vs spin", "reader CPU %", "% of spin's CPU",
         "paced hit/early/late"],
        prow,
        note=(("Goal: the paced reader at 0.5 and 1.4 ms within 1.2x of the spinning reader's p50 at <= 25 % of its "
               "CPU (a host where reader and writer never share a CPU). ") if pin else
              ("Goals: the adaptive/default reader within 2x of the spinning reader's p50 at <= 25 % of its CPU; the "
               "paced reader at 1 and 1.4 ms within 1.2x at <= 25 %. ")) +
        "paced: waits that saw the message in the spin window (hit), were woken in the timed park by an early "
        "message (early), or parked after the window (late).",
        key="periodic_pinned" if pin else "periodic")
    return per, t


def _periodic_median(runs: list[dict]) -> dict:
    out = {"latency": {k: median([r["latency"][k] for r in runs]) for k in runs[0]["latency"]},
           "reader_cpu_pct": median([r["reader_cpu_pct"] for r in runs])}
    if "paced" in runs[0]:
        out["paced"] = {k: median([r["paced"][k] for r in runs]) for k in runs[0]["paced"]}
        out["paced"] = {k: int(v) if k in ("predicted", "hit", "early", "late", "samples", "misses") else v
                        for k, v in out["paced"].items()}
    return out


# ---- run -----------------------------------------------------------------------------------------------------


def _ratio(x, floor):
    return x / floor if floor else float("nan")


def _alternating_runs(peers, remote, runs, rounds, warmup, remote_rounds, n_through, progress):
    """Tables (a), (b) and (r)'s measurements, every peer once per run; (round trips, throughputs, remote round
    trips), each the medians over the runs."""
    rt_runs = {(p.name, size): [] for p in peers for size in (SMALL, LARGE)}
    thr_runs = {p.name: [] for p in peers}
    remote_runs = {p.name: [] for p in remote}
    for i in range(runs):  # alternating: every peer once per run, so drift in the machine's load hits all alike
        for peer in peers:
            for size in (SMALL, LARGE):
                progress.step(f"run {i + 1}/{runs}: round trip {peer.name} {size} B")
                rt_runs[(peer.name, size)].append(_round_trip(peer, size, rounds, warmup))
            progress.step(f"run {i + 1}/{runs}: throughput {peer.name}")
            thr_runs[peer.name].append({"msgs_per_s": _throughput(peer, n_through)})
        for peer in remote:
            progress.step(f"run {i + 1}/{runs}: remote round trip {peer.name}")
            remote_runs[peer.name].append(_round_trip(peer, SMALL, remote_rounds, remote_rounds // 10))
    rt = {k: _medians(v) for k, v in rt_runs.items()}
    thr = {k: _medians(v) for k, v in thr_runs.items()}
    rem = {k: _medians(v) for k, v in remote_runs.items()}
    return rt, thr, rem


def _round_trip_table(peers, rt, runs, rounds, warmup):
    """Table (a): each peer's round trip next to its floor's."""
    rows = []
    for peer in peers:
        sm, lg, fl = rt[(peer.name, SMALL)], rt[(peer.name, LARGE)], peer.floor
        fs = rt[(fl, SMALL)] if fl else None
        rows.append([peer.name, sm["p50_us"], sm["p99_us"], sm["p99.9_us"], lg["p50_us"], lg["p99_us"],
                     fl or "(a floor)", fmt(_ratio(sm["p50_us"], fs["p50_us"]), 2) if fs else "-",
                     fmt(_ratio(sm["p99_us"], fs["p99_us"]), 2) if fs else "-",
                     fmt(_ratio(lg["p50_us"], rt[(fl, LARGE)]["p50_us"]), 2) if fs else "-"])
    missing = [what for what, ok in (("vLLM's MessageQueue (not importable)", _installed("vllm")),
                                     ("faster-fifo (pip install hotloop[bench])", _installed("faster_fifo")),
                                     ("pyzmq", _installed("zmq"))) if not ok]
    method = (f"median of {runs} alternating runs; each run: {rounds} round trips after {warmup} warm-up")
    return table(
        f"(a) round trip between two processes, us ({method}); each row next to its floor, same run",
        ["transport", "64B p50", "p99", "p99.9", "64KiB p50", "p99", "floor", "64B p50 / floor", "p99 / floor",
         "64KiB p50 / floor"],
        rows,
        note="Objects are {'payload': bytes(n)}, pickled (vLLM's queue pickles too). Goals: objects p50 <= 1.5x "
        "and p99 <= 3x the bytes path. 'bytes path + pickle.dumps/loads' pickles around enqueue_bytes/dequeue_bytes "
        "in Python: what pickle itself adds, the object path's own floor." +
        (f" Not measured: {', '.join(missing)}." if missing else ""), key="round_trip_us",
    )


def _throughput_table(peers, thr, runs, n_through):
    """Table (b): each peer's one-way throughput next to its floor's."""
    trows = []
    for peer in peers:
        rate, fl = thr[peer.name]["msgs_per_s"], peer.floor
        trows.append([peer.name, rate / 1e6, fl or "(a floor)",
                      fmt(_ratio(rate, thr[fl]["msgs_per_s"]), 2) if fl else "-"])
    return table(
        f"(b) one-way throughput of 64 B messages ({n_through} messages; median of {runs} alternating runs)",
        ["transport", "M msg/s", "floor", "rate / floor"], trows,
        note="Goals: objects >= 0.6x the bytes path; bytes path >= 0.9x the spin ring. 'bytes path + "
        "pickle.dumps/loads': the object path's own floor (see (a)).", key="throughput_msgs_per_s")


def _remote_table(remote, rem, runs, remote_rounds):
    """Table (r): each remote transport's round trip against plain and CURVE PUB/SUB."""
    plain, curve = rem[_PubSub.name], rem[_PubSubCurve.name]
    rrows = []
    for peer in remote:
        r = rem[peer.name]
        rrows.append([peer.name, "yes" if peer in (_PubSubCurve, _HotloopRemote) else "no", r["p50_us"],
                      r["p99_us"], r["p99.9_us"], fmt(_ratio(r["p50_us"], plain["p50_us"]), 2),
                      fmt(_ratio(r["p50_us"], curve["p50_us"]), 2)])
    return table(
        f"(r) remote: 64 B round trip over TCP loopback, us (median of {runs} alternating runs of {remote_rounds} "
        "round trips)",
        ["transport", "CURVE", "p50", "p99", "p99.9", "p50 / PUB/SUB no CURVE", "p50 / PUB/SUB CURVE"], rrows,
        note="hotloop: enqueue_bytes/dequeue_bytes, a remote reader on each side (authenticated CurveZMQ, "
        "no-drop backpressure, liveness). Goals: p50 <= 1.3x plain PUB/SUB and <= 1.1x CURVE PUB/SUB; the CURVE "
        "column says what encryption costs by itself, the last ratio what hotloop adds beyond it.",
        key="remote_round_trip_us")


def run(quick: bool = False, runs: int = 5):
    rounds, warmup = (1000, 100) if quick else (10000, 1000)
    remote_rounds = 300 if quick else 3000
    n_through = 20_000 if quick else 200_000
    big = (64 if quick else 256) << 20
    idle_s = 1.0 if quick else 5.0
    peers, remote = _peers(), _remote_peers()
    progress = Progress("bench queue", runs * (3 * len(peers) + len(remote)) + 2 + 2 * len(PERIODS) * len(POLICIES)
                        + runs * (2 * len(relay_bench.KS) + len(relay_bench.RT_ARMS)))
    rt, thr, rem = _alternating_runs(peers, remote, runs, rounds, warmup, remote_rounds, n_through, progress)
    progress.step("large message")
    bigr = _big_message(big)
    progress.step("idle reader")
    idle_pct = _idle(idle_s)
    per, periodic_table = periodic(quick, 1, progress)
    per_pinned, pinned_table = periodic(quick, 1, progress, pin=True)
    relay_data, relay_tables = relay_bench.run(quick, runs, progress)
    progress.close()

    text = Report()
    text.append(_round_trip_table(peers, rt, runs, rounds, warmup))
    text.append(_throughput_table(peers, thr, runs, n_through))
    text.append(_remote_table(remote, rem, runs, remote_rounds))
    text.append(table(
        f"(c) a {bigr['bytes'] >> 20} MiB {bigr['kind']} through the queue, 5 times",
        ["first GB/s", "then (median) GB/s", "memcpy GB/s", "% of memcpy"],
        [[fmt(bigr["first_GBps"], 2), fmt(bigr["steady_GBps"], 2), fmt(bigr["memcpy_GBps"], 2),
          fmt(bigr["pct_of_memcpy"])]],
        note="enqueue start -> reader has the tensor: two copies (into the ring, out of it, pipelined by record). "
        "The first transfer also pays for the reader's fresh memory (page faults); later ones reuse it.",
        key="large_message"))
    text.append(table(
        f"(d) a reader parked {idle_s:.0f} s on an empty queue", ["reader CPU % of a core"], [[fmt(idle_pct, 3)]],
        key="idle_reader_cpu_pct"))
    text.append(periodic_table)
    text.append(pinned_table)
    data = {
        "runs": runs,
        "round_trip_us": {f"{k[0]} {k[1]}B": v for k, v in rt.items()},
        "throughput_msgs_per_s": thr,
        "remote_round_trip_us": rem,
        "large_message": bigr,
        "idle_reader_cpu_pct": idle_pct,
        "periodic": {f"{_period_key(k[0])} {k[1]}": v for k, v in per.items()},
        "periodic_pinned": {f"{_period_key(k[0])} {k[1]}": v for k, v in per_pinned.items()},
        **relay_data,
    }
    for t in relay_tables:
        text.append(t)
    data["goals"] = check_goals(goals(data), data)
    return data, text


def goals(data: dict) -> list[Goal]:
    """The goals stated under tables (a), (b), (r) and (e), one per row and figure (the report page's verdict)."""
    objects, by_bytes = _HotloopObjects.name, _Hotloop.name
    out = []
    for size, label in ((SMALL, "64 B"), (LARGE, "64 KiB")):
        for q, limit in (("p50", 1.5), ("p99", 3.0)):
            out.append(Goal(f"(a) round trip {label}: objects {q} within {limit:g}x the bytes path", "round_trip_us",
                            f"{objects} {size}B", f"{q}_us", "<=", limit, against=f"{by_bytes} {size}B", unit="us"))
    out.append(Goal("(b) throughput: objects >= 0.6x the bytes path", "throughput_msgs_per_s", objects, "msgs_per_s",
                    ">=", 0.6, against=by_bytes, unit="msg/s"))
    out.append(Goal("(b) throughput: the bytes path >= 0.9x the spin ring", "throughput_msgs_per_s", by_bytes,
                    "msgs_per_s", ">=", 0.9, against=_SpinRing.name, unit="msg/s"))
    out.append(Goal("(r) remote round trip: hotloop p50 within 1.3x plain PUB/SUB", "remote_round_trip_us",
                    _HotloopRemote.name, "p50_us", "<=", 1.3, against=_PubSub.name, unit="us"))
    out.append(Goal("(r) remote round trip: hotloop p50 within 1.1x CURVE PUB/SUB (what hotloop adds to the "
                    "encrypted transport)", "remote_round_trip_us", _HotloopRemote.name, "p50_us", "<=", 1.1,
                    against=_PubSubCurve.name, unit="us"))
    out += relay_bench.goals(data)
    for key, mode in (("periodic", ""), ("periodic_pinned", ", pinned")):
        for spin in (k for k in data.get(key, {}) if k.endswith(" always spin")):
            period = spin[:-len(" always spin")]
            for policy in ("default (spin 20 us, yield 10 us)", "adaptive") if key == "periodic" else ():
                row = f"{period} {policy}"
                out.append(Goal(f"(e) every {period}: the {policy} reader within 2x of always spin (p50)", key,
                                row, "latency.p50_us", "<=", 2.0, against=spin, unit="us"))
                out.append(Goal(f"(e) every {period}: the {policy} reader's CPU <= 25 % of always spin's", key,
                                row, "reader_cpu_pct", "<=", 0.25, against=spin, unit="%"))
            if period in PACED_GOAL_PERIODS[key] and f"{period} paced" in data[key]:
                row = f"{period} paced"
                out.append(Goal(f"(e) every {period}{mode}: the paced reader within 1.2x of always spin (p50)", key,
                                row, "latency.p50_us", "<=", 1.2, against=spin, unit="us"))
                out.append(Goal(f"(e) every {period}{mode}: the paced reader's CPU <= 25 % of always spin's", key,
                                row, "reader_cpu_pct", "<=", 0.25, against=spin, unit="%"))
    return out


_SHORT = {"spin": "always spin", "park": "always park", "default": "default (spin 20 us, yield 10 us)",
          "adaptive": "adaptive", "paced": "paced", "zmq": ZMQ_ROW}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.queue_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["periodic"], help="run one section alone (default: every section)")
    ap.add_argument("--full", action="store_true", help="the long run (default: the short one)")
    ap.add_argument("--runs", type=int, default=None, help="alternating runs (default 5; --only periodic: 3)")
    ap.add_argument("--periods", default=None,
                    help="--only periodic: periods in ms with their jitter, e.g. '1:0.2,1.4:0.1' (default: all)")
    ap.add_argument("--policies", default=None,
                    help=f"--only periodic: comma-separated, from {list(_SHORT)} (default: all)")
    ap.add_argument("--pin", action="store_true",
                    help="--only periodic: reader and writer on two different CPUs (a host with cores to spare)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.only == "periodic":
        periods = PERIODS
        if args.periods:
            periods = tuple((float(p) / 1e3, float(j)) for p, j in (x.split(":") for x in args.periods.split(",")))
        policies = [_SHORT[x.strip()] for x in args.policies.split(",")] if args.policies else None
        per, t = periodic(not args.full, args.runs or 3, None, periods, policies, args.pin)
        key = "periodic_pinned" if args.pin else "periodic"
        data = {key: {f"{_period_key(k[0])} {k[1]}": v for k, v in per.items()}}
        data["goals"] = check_goals([g for g in goals(data) if g.table == key], data)
        text = Report([t])
    else:
        data, text = run(not args.full, args.runs or 5)
    from hotloop.bench.report import print_result

    return print_result("queue", data, text, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
