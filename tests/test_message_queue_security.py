"""The network path of hotloop.MessageQueue against peers that are not its readers (all on loopback): it binds
only the address it advertises, strangers (no CURVE, a wrong server key, an unknown client key) are refused and
counted, they neither read, count as ready nor stall enqueue; an authenticated peer cannot forge another rank's
leave or break enqueue with malformed frames; a reader never takes messages from an impostor on its writer's
port; the handle's repr hides the keys."""

import multiprocessing as mp
import os
import signal
import threading

import pytest
import zmq

from hotloop import DeadPeerError, MessageQueue, QueueTimeout
from hotloop.queue.remote.wire import rank_topic

CTX = mp.get_context("fork")
LOOPBACK = "127.0.0.1"


def _port(handle) -> int:
    return int(handle.remote_address.rsplit(":", 1)[1])


def _listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket of this machine listens on at `port` (from /proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            ip_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def _wait_for(pred, timeout=5.0):
    import time
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_publisher_binds_only_the_address_it_advertises():
    with MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK) as q:
        assert _listening_addresses(_port(q.export_handle())) == {LOOPBACK}


@pytest.mark.parametrize("stranger", ["plain", "wrong_server_key", "unknown_client_key"])
def test_strangers_are_refused_and_never_count_as_a_reader(zctx, stranger):
    with MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK) as q:
        h = q.export_handle()
        sock = zctx.socket(zmq.SUB)
        if stranger != "plain":
            server_key = zmq.curve_keypair()[0] if stranger == "wrong_server_key" else h.remote_server_key
            sock.curve_serverkey = server_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.SUBSCRIBE, rank_topic(0))  # claims rank 0, the only reader
        sock.connect(h.remote_address)
        _wait_for(lambda: q.network_stats["rejected_peers"] >= 1)
        with pytest.raises(QueueTimeout, match="0 of 1 remote"):
            q.wait_until_ready(timeout=0.3)
        assert q.network_stats["attached"] == []
        # the real reader attaches beside the stranger and is the only one that receives
        reader = MessageQueue.create_from_handle(h, 0)
        q.wait_until_ready(timeout=10)
        q.enqueue({"secret": 42}, timeout=5)
        assert reader.dequeue(timeout=5) == {"secret": 42}
        assert sock.poll(200) == 0, "a stranger received a message"
        reader.close()
        sock.close(linger=0)


def test_a_stranger_that_never_reads_cannot_stall_enqueue(zctx):
    with MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK, remote_hwm=2) as q:
        h = q.export_handle()
        stranger = zctx.socket(zmq.SUB)
        stranger.setsockopt(zmq.RCVHWM, 1)
        stranger.setsockopt(zmq.SUBSCRIBE, b"")
        stranger.connect(h.remote_address)
        reader = MessageQueue.create_from_handle(h, 0)
        q.wait_until_ready(timeout=10)
        block = bytes(64 << 10)
        for i in range(300):  # 19 MiB: far past the high-water marks and socket buffers; the stranger never reads
            q.enqueue_bytes(block, timeout=5)
            assert reader.dequeue_bytes(timeout=5) == block
        reader.close()
        stranger.close(linger=0)


def test_queues_of_one_process_admit_only_their_own_readers_keys(zctx):
    """The writers of one process share one ZAP handler: a key of queue A (a real reader of A) is refused by queue
    B, closing A leaves B serving its reader, and closing the last one ends the ZAP handler's thread."""
    threads = threading.active_count()
    a = MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK)
    b = MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK)
    ha, hb = a.export_handle(), b.export_handle()
    sock = zctx.socket(zmq.SUB)
    sock.curve_serverkey = hb.remote_server_key
    sock.curve_publickey, sock.curve_secretkey = ha.remote_client_keys[0]  # A's rank-0 keys at B's address
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.SUBSCRIBE, rank_topic(0))
    sock.connect(hb.remote_address)
    _wait_for(lambda: b.network_stats["rejected_peers"] >= 1)
    with pytest.raises(QueueTimeout, match="0 of 1 remote"):
        b.wait_until_ready(timeout=0.3)
    reader_a = MessageQueue.create_from_handle(ha, 0)
    a.wait_until_ready(timeout=10)
    a.enqueue("to a", timeout=5)
    assert reader_a.dequeue(timeout=5) == "to a"
    reader_a.close()
    a.close()
    reader_b = MessageQueue.create_from_handle(hb, 0)
    b.wait_until_ready(timeout=10)
    b.enqueue("to b", timeout=5)
    assert reader_b.dequeue(timeout=5) == "to b"
    assert sock.poll(200) == 0, "a reader of another queue received a message"
    reader_b.close()
    b.close()
    sock.close(linger=0)
    assert threading.active_count() == threads


def _authenticated_raw_peer(ctx, handle, rank):
    """A raw XSUB socket holding `rank`'s keys: an authenticated peer that can send arbitrary frames."""
    sock = ctx.socket(zmq.XSUB)
    sock.curve_serverkey = handle.remote_server_key
    sock.curve_publickey, sock.curve_secretkey = handle.remote_client_keys[rank - handle.n_local_reader]
    sock.connect(handle.remote_address)
    return sock


def test_an_authenticated_peer_cannot_forge_another_ranks_leave_or_break_enqueue(zctx):
    with MessageQueue(2, n_local_reader=0, connect_ip=LOOPBACK) as q:
        h = q.export_handle()
        reader1 = MessageQueue.create_from_handle(h, 0)
        peer = _authenticated_raw_peer(zctx, h, 1)
        peer.send(b"\x01" + rank_topic(1))  # rank 1 attaches properly
        q.wait_until_ready(timeout=10)
        for frame in (b"\x01" + rank_topic(0),  # forged second attach of rank 0
                      b"\x00" + rank_topic(0),  # forged leave of rank 0 (XSUB sends only a subscribed topic's)
                      b"", b"\x07junk", b"\x01\x01hotloop-rank-99"):
            peer.send(frame)
        _wait_for(lambda: q.network_stats["ignored_frames"] >= 5)
        for i in range(20):
            q.enqueue(i, timeout=5)  # neither DeadPeerError for rank 0 nor an exception from the frames
            assert reader1.dequeue(timeout=5) == i
        assert q.network_stats["attached"] == [0, 1]
        reader1.close()
        peer.close(linger=0)


def _writer_then_die(handle_pipe, port_pipe):
    q = MessageQueue(1, n_local_reader=0, connect_ip=LOOPBACK)
    handle_pipe.send(q.export_handle())
    q.wait_until_ready(timeout=30)
    q.enqueue("from the writer", timeout=5)
    port_pipe.recv()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_reader_never_takes_messages_from_an_impostor_on_its_writers_port():
    a, b = CTX.Pipe()
    c, d = CTX.Pipe()
    writer = CTX.Process(target=_writer_then_die, args=(b, d))
    writer.start()
    h = a.recv()
    reader = MessageQueue.create_from_handle(h, 0)
    assert reader.dequeue(timeout=10) == "from the writer"
    c.send("die")
    writer.join(10)
    # an impostor takes the port: plain, and with CURVE under a server key of its own
    for secure in (False, True):
        ictx = zmq.Context()  # destroyed below, which waits until the port is free again
        impostor = ictx.socket(zmq.XPUB)
        if secure:
            impostor.curve_server = True
            impostor.curve_publickey, impostor.curve_secretkey = zmq.curve_keypair()
        impostor.bind(f"tcp://{LOOPBACK}:{_port(h)}")
        for _ in range(20):
            impostor.send_multipart([b"M", b"\x80\x05\x95forged"])
        with pytest.raises(DeadPeerError, match="lost the connection"):
            reader.dequeue(timeout=3)
        ictx.destroy(linger=0)
    reader.close()
    for p in (a, b, c, d):
        p.close()


def test_handle_repr_hides_the_keys():
    with MessageQueue(2, n_local_reader=1, connect_ip=LOOPBACK) as q:
        h = q.export_handle()
        text = repr(h)
        assert h.remote_server_key.decode() not in text
        assert all(k.decode() not in text for pair in h.remote_client_keys for k in pair)


def test_a_handle_with_keys_zeromq_refuses_fails_at_once_and_hangs_nothing(tmp_path):
    # the reader in a process of its own, where it is the ZeroMQ context's only user: before the fix its socket
    # was left open when the keys were refused, and the context's term() waited for it forever
    import dataclasses
    import pickle
    import subprocess
    import sys

    with MessageQueue(2, 1, connect_ip="127.0.0.1") as w:
        bad = dataclasses.replace(w.export_handle(), remote_client_keys=((b"~" * 40, b"~" * 40),))
        (tmp_path / "handle").write_bytes(pickle.dumps(bad))
        code = ("import pickle, sys\nfrom hotloop import MessageQueue\n"
                "h = pickle.load(open(sys.argv[1], 'rb'))\n"
                "try:\n    MessageQueue.create_from_handle(h, 1)\n"
                "except Exception as e:\n    print('raised', type(e).__name__, e)\n")
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "handle")], capture_output=True,
                              text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("raised "), (done.stdout, done.stderr[-2000:])
