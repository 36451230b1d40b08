"""64-byte round trip between two processes: MessageQueue with a shared-memory reader, MessageQueue with a remote
(TCP loopback) reader, and plain pyzmq PUB/SUB over TCP loopback with blocking receives (the baseline), in one run.

    python benchmarks/python/remote_round_trip.py [rounds]
"""

import multiprocessing as mp
import sys
import time

import zmq

from hotloop import MessageQueue

CTX = mp.get_context("spawn")


def _mq_echo(handle, conn, n_local):
    r = MessageQueue.create_from_handle(handle, 0)
    back = MessageQueue(1, n_local_reader=n_local, connect_ip="127.0.0.1")
    conn.send(back.export_handle())
    back.wait_until_ready(30)
    while True:
        try:
            m = r.dequeue_bytes(timeout=30)
        except Exception:
            break
        back.enqueue_bytes(m)
    back.close()


def _zmq_echo(port, conn):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    pub = ctx.socket(zmq.PUB)
    conn.send(pub.bind_to_random_port("tcp://127.0.0.1"))
    while (m := sub.recv()) != b"stop":
        pub.send(m)


def _measure(send, recv, rounds):
    lat = []
    for i in range(rounds + rounds // 10):
        t = time.perf_counter_ns()
        send(b"x" * 64)
        recv()
        lat.append(time.perf_counter_ns() - t)
    lat = sorted(lat[rounds // 10:])
    return lat[len(lat) // 2] / 1e3, lat[int(len(lat) * 0.99)] / 1e3


def main(rounds: int = 5000):
    rows = []
    for n_local, name in ((1, "MessageQueue, shared-memory reader"), (0, "MessageQueue, remote reader (TCP)")):
        ab = MessageQueue(1, n_local_reader=n_local, connect_ip="127.0.0.1")
        a, b = CTX.Pipe()
        p = CTX.Process(target=_mq_echo, args=(ab.export_handle(), b, n_local))
        p.start()
        back = MessageQueue.create_from_handle(a.recv(), 0)
        ab.wait_until_ready(30)
        rows.append((name, *_measure(ab.enqueue_bytes, lambda: back.dequeue_bytes(timeout=10), rounds)))
        ab.shutdown()
        p.join(10)
        ab.close()
        back.close()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    a, b = CTX.Pipe()
    p = CTX.Process(target=_zmq_echo, args=(pub.bind_to_random_port("tcp://127.0.0.1"), b))
    p.start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{a.recv()}")
    while True:  # PUB/SUB joins late: send until the echo answers
        pub.send(b"x")
        if sub.poll(100):
            sub.recv()
            break
    while sub.poll(100):
        sub.recv()
    rows.append(("pyzmq PUB/SUB (TCP), blocking recv", *_measure(pub.send, sub.recv, rounds)))
    pub.send(b"stop")
    p.join(10)
    ctx.destroy(0)
    print(f"64 B round trip between two processes, {rounds} rounds (us)")
    for name, p50, p99 in rows:
        print(f"  {name:40s} p50 {p50:8.1f}   p99 {p99:8.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)
