"""64-byte round trip between two processes: MessageQueue with a shared-memory reader, MessageQueue with a remote
(TCP loopback, CurveZMQ) reader, and plain pyzmq PUB/SUB over TCP loopback with blocking receives, without and with
CURVE (the baselines: what the transport costs, and what its encryption costs), in one run.
``hotloop bench queue`` runs the same comparison over alternating runs (its table (r)).

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


def _curve(pub, sub, server_public, server_secret):
    """CURVE on both sockets (no ZAP handler: hotloop's runs once per connection, not per message)."""
    pub.curve_server, pub.curve_publickey, pub.curve_secretkey = True, server_public, server_secret
    sub.curve_serverkey = server_public
    sub.curve_publickey, sub.curve_secretkey = zmq.curve_keypair()


def _zmq_echo(port, conn, keys):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    pub = ctx.socket(zmq.PUB)
    if keys:  # one key pair for both directions: the floor measures the cipher, not key management
        _curve(pub, sub, *keys)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
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


def _zmq_round_trip(keys, rounds):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    sub = ctx.socket(zmq.SUB)
    if keys:
        _curve(pub, sub, *keys)
    a, b = CTX.Pipe()
    p = CTX.Process(target=_zmq_echo, args=(pub.bind_to_random_port("tcp://127.0.0.1"), b, keys))
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
    figures = _measure(pub.send, sub.recv, rounds)
    pub.send(b"stop")
    p.join(10)
    ctx.destroy(0)
    return figures


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
    for keys, name in ((None, "pyzmq PUB/SUB (TCP), blocking recv"),
                       (zmq.curve_keypair(), "pyzmq PUB/SUB (TCP, CURVE), blocking recv")):
        rows.append((name, *_zmq_round_trip(keys, rounds)))
    print(f"64 B round trip between two processes, {rounds} rounds (us)")
    for name, p50, p99 in rows:
        print(f"  {name:44s} p50 {p50:8.1f}   p99 {p99:8.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)
