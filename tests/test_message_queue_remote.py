"""What only hotloop.MessageQueue's network readers have (over TCP, here on loopback): delivery next to
shared-memory readers, a full send buffer, a rank attached twice, a second reader racing the wait. What both kinds
of reader share (wait_any, Waiter, asyncio, dead writer / dead reader) runs over both in test_message_queue.py."""

import hashlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest

from conftest import thread_sleeping, wait_until

import hotloop
from hotloop import ClosedError, DeadPeerError, MessageQueue, QueueTimeout
from hotloop.queue import serialization

CTX = mp.get_context("fork")
CHUNK = (1 << 16) // 4 - 64  # a 64 KiB ring for the local reader


def _payload(seq: int) -> bytes:
    rng = random.Random(seq)
    size = rng.randrange(4 << 16) if rng.random() < 0.02 else rng.randrange(2048)
    return rng.randbytes(size)


def _reader_main(handle, rank, count, results):
    try:
        q = MessageQueue.create_from_handle(handle, rank)
        digest = hashlib.blake2b()
        for seq in range(count):
            msg = q.dequeue(timeout=30)
            assert msg["seq"] == seq, f"rank {rank}: got message {msg['seq']}, expected {seq}"
            assert msg["sum"] == hashlib.blake2b(msg["data"]).hexdigest(), f"rank {rank}: bad checksum at {seq}"
            digest.update(msg["data"])
        try:
            q.dequeue(timeout=10)
            end = "a message after shutdown"
        except ClosedError:
            end = "closed"
        q.close()
        results.put((rank, digest.hexdigest(), end))
    except BaseException as e:  # report, do not hang the writer
        results.put((rank, f"error: {e!r}", ""))


def test_remote_and_local_readers_get_every_message_once_in_order():
    count = 2000
    q = MessageQueue(3, n_local_reader=1, max_chunk_bytes=CHUNK, connect_ip="127.0.0.1")
    h = q.export_handle()
    assert h.remote_address.startswith("tcp://127.0.0.1:") and len(__import__("pickle").dumps(h)) < 1000
    results = CTX.Queue()
    procs = [CTX.Process(target=_reader_main, args=(h, r, count, results)) for r in range(3)]
    for p in procs:
        p.start()
    q.wait_until_ready(timeout=30)
    digest = hashlib.blake2b()
    for seq in range(count):
        data = _payload(seq)
        digest.update(data)
        q.enqueue({"seq": seq, "data": data, "sum": hashlib.blake2b(data).hexdigest()}, timeout=30)
    q.shutdown()
    got = {r: (d, end) for r, d, end in (results.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(30)
    q.close()
    assert got == {r: (digest.hexdigest(), "closed") for r in range(3)}


def test_one_part_and_several_part_messages_reach_a_remote_reader_whole_and_in_order():
    np = pytest.importorskip("numpy")
    with MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1") as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.wait_until_ready(timeout=10)
        arr = np.arange(5000, dtype=np.int32)
        sent = [b"S", {"small": 1}, {"arr": arr}, b"", "x" * 200_000, bytes([0x80, 5]), {"arr": arr[::-1].copy()}]
        for obj in sent[:3]:
            q.enqueue(obj)
        q.enqueue_bytes(sent[3])  # an empty message, and one starting like a frame kind: data, never control
        q.enqueue(sent[4])
        q.enqueue_bytes(sent[5])
        q.enqueue(sent[6])
        assert r.dequeue(timeout=5) == b"S" and r.dequeue(timeout=5) == {"small": 1}
        assert np.array_equal(r.dequeue(timeout=5)["arr"], arr)  # header, pickle, buffer: several frames
        assert bytes(r.dequeue_bytes(timeout=5)) == b""
        assert r.dequeue(timeout=5) == sent[4]  # a pickle over 64 KiB: several chunks
        assert bytes(r.dequeue_bytes(timeout=5)) == sent[5]
        got = r.dequeue_bytes(timeout=5)
        assert not memoryview(got).readonly  # the reader's own buffer
        assert np.array_equal(serialization.loads(got)["arr"], arr[::-1])
        q.shutdown()
        with pytest.raises(ClosedError):
            r.dequeue(timeout=5)
        r.close()


def _read_until_shutdown(handle, report, gap_s=0.0):
    r = MessageQueue.create_from_handle(handle, 0)
    report.send("attached")
    got = 0
    try:
        while True:
            r.dequeue_bytes(timeout=60)
            got += 1
            time.sleep(gap_s)
    except ClosedError:
        report.send(got)
    except BaseException as e:
        report.send(f"{got} then {e!r}")
    r.close()
    os._exit(0)


def _stopped_reader(q):
    """A reader process of `q` (rank 0), attached, then stopped (SIGSTOP); it reports what it read once resumed."""
    report, child_end = CTX.Pipe()
    child = CTX.Process(target=_read_until_shutdown, args=(q.export_handle(), child_end))
    child.start()
    assert report.poll(30) and report.recv() == "attached"
    q.wait_until_ready(timeout=30)
    os.kill(child.pid, signal.SIGSTOP)
    wait_until(lambda: open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 10)
    return child, report, child_end


def _end(child, q, report, child_end) -> None:
    """After a test with a reader process: let it run, wait for it, close the queue and the report pipe."""
    os.kill(child.pid, signal.SIGCONT)
    child.join(30)
    q.close()
    report.close()
    child_end.close()


def test_a_remote_reader_that_takes_nothing_in_makes_enqueue_time_out_and_loses_nothing():
    """A reader's process that takes nothing in (stopped, or its node overloaded) fills the writer's remote_hwm
    and the kernel's buffers: enqueue raises QueueTimeout naming it; once it runs again it reads every message
    that was sent. (A reader that is alive but does not read takes messages into its process: its ZeroMQ
    buffer is not bounded, see sockets.keepalive.)"""
    q = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1", remote_hwm=2)
    child, report, child_end = _stopped_reader(q)
    try:
        big = b"z" * (1 << 20)
        sent = 0
        with pytest.raises(QueueTimeout, match="remote reader .* behind"):
            for _ in range(1000):  # far more than the writer's 2 and the kernel's buffers hold
                q.enqueue_bytes(big, timeout=0.2)
                sent += 1
        assert sent >= 2
        os.kill(child.pid, signal.SIGCONT)
        q.close()
        assert report.poll(30) and report.recv() == sent
    finally:
        _end(child, q, report, child_end)


def test_remote_bad_input_gives_clear_errors():
    q = MessageQueue(2, n_local_reader=1, max_chunk_bytes=CHUNK, max_message_bytes=5000, connect_ip="127.0.0.1")
    h = q.export_handle()
    with pytest.raises(hotloop.BadHandleError, match="out of range"):
        MessageQueue.create_from_handle(h, 2)
    with pytest.raises(QueueTimeout, match="0 of 1 local and 0 of 1 remote readers attached"):
        q.wait_until_ready(timeout=0.2)
    local = MessageQueue.create_from_handle(h, 0)
    r1 = MessageQueue.create_from_handle(h, 1)
    r1_again = MessageQueue.create_from_handle(h, 1)
    def second_subscription_seen():
        q.network_stats  # takes in the subscription frames that arrived (poll_peers)
        return bool(q._remote.twice)

    with pytest.raises(DeadPeerError, match="rank 1 attached twice"):
        q.wait_until_ready(timeout=5)
        wait_until(second_subscription_seen, what="the writer taking in rank 1's second subscription")
        q.enqueue(0)
    r1_again.close()
    with pytest.raises(ValueError, match="larger than max_message_bytes"):
        q.enqueue_bytes(b"x" * 6000)
    with pytest.raises(RuntimeError, match="only the writer"):
        r1.enqueue(1)
    q.enqueue("kept")
    assert r1.dequeue(timeout=5) == "kept" and local.dequeue(timeout=5) == "kept"
    q.shutdown()
    with pytest.raises(ClosedError):
        q.enqueue(1)
    with pytest.raises(ClosedError):
        r1.dequeue(timeout=5)
    for x in (q, local, r1):
        x.close()


def _paced_reader(handle, rank, results):
    q = MessageQueue.create_from_handle(handle, rank)
    rng = random.Random(rank)
    n = 0
    try:
        while True:
            q.dequeue_bytes(timeout=2)  # a lost wake-up shows as a QueueTimeout here
            n += 1
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.0005)
    except ClosedError:
        results.put((rank, n))
    except BaseException as e:
        results.put((rank, f"after {n} messages: {e!r}"))
    q.close()


def test_no_lost_wake_up_when_messages_race_the_readers_wait():
    count = 5000
    q = MessageQueue(2, n_local_reader=0, connect_ip="127.0.0.1")
    results = CTX.Queue()
    procs = [CTX.Process(target=_paced_reader, args=(q.export_handle(), r, results)) for r in range(2)]
    for p in procs:
        p.start()
    q.wait_until_ready(timeout=10)
    rng = random.Random(7)
    for _ in range(count):
        q.enqueue_bytes(b"x" * (rng.randrange(100_000) if rng.random() < 0.05 else rng.randrange(100)), timeout=10)
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.0005)
    q.shutdown()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    q.close()
    assert got == {0: count, 1: count}


def _write_close_and_exit(handle_out, go, keep_another_end: bool, count: int):
    q = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
    other = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1") if keep_another_end else None
    handle_out.send(q.export_handle())
    go.recv()
    q.wait_until_ready(timeout=30)
    for i in range(count):
        q.enqueue_bytes(i.to_bytes(4, "little") * (1 << 14), timeout=30)  # 64 KiB: ZeroMQ queues them
    q.close()
    os._exit(0)  # no interpreter shutdown: what close() returned with is all that was sent


@pytest.mark.parametrize("keep_another_end", [False, True])
def test_a_writer_closed_while_its_process_has_other_queue_ends_still_delivers_what_it_sent(keep_another_end):
    """close() returns once the writer's queued messages went out (ZeroMQ's linger), also when the process's
    shared ZeroMQ context lives on for its other queue ends; the process may exit right after."""
    count = 200
    a, b = CTX.Pipe()
    go_a, go_b = CTX.Pipe()
    child = CTX.Process(target=_write_close_and_exit, args=(b, go_b, keep_another_end, count))
    child.start()
    r = MessageQueue.create_from_handle(a.recv(), 0)
    go_a.send(1)
    got = [int.from_bytes(r.dequeue_bytes(timeout=30)[:4], "little") for _ in range(count)]
    assert got == list(range(count))
    with pytest.raises(ClosedError):
        r.dequeue_bytes(timeout=30)  # and the shutdown after them
    r.close()
    child.join(30)
    assert child.exitcode == 0


def test_a_writer_closed_while_a_reader_is_stopped_waits_until_the_reader_has_the_tail():
    """A writer that closes with a backlog in flight to a live reader that is stopped for a moment (a loaded host;
    on a lossy link, retransmissions backed off) waits until the reader's side has acknowledged it all: the reader
    gets every message and the shutdown. (Once ZeroMQ had handed the tail to the kernel it closed the
    connection, and the reset threw away what the reader had not acknowledged yet.)"""
    q = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
    child, report, child_end = _stopped_reader(q)
    count, stopped_s = 300, 1.5  # 19 MB: more than the kernel's buffers on both sides hold
    try:
        for i in range(count):
            q.enqueue_bytes(i.to_bytes(4, "little") * (1 << 14), timeout=30)
        resume = threading.Timer(stopped_s, os.kill, (child.pid, signal.SIGCONT))
        resume.start()
        t0 = time.monotonic()
        q.close()
        closed_in = time.monotonic() - t0
        resume.join()
        assert report.poll(30) and report.recv() == count
        assert closed_in >= stopped_s * 0.5  # close() waited for the stopped reader
    finally:
        _end(child, q, report, child_end)


def test_a_slow_reader_whose_writer_closes_reads_everything_and_lives():
    """A reader far behind its writer (here 19 MB, read a message every 10 ms) when the writer closes reads every
    message and then the shutdown. (With its ZeroMQ receive buffer bounded by remote_hwm and heartbeats on,
    libzmq 4.3.5 aborted such a reader's process when the closing writer's connection was reset:
    sockets.keepalive.)"""
    q = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1", remote_hwm=50)
    report, child_end = CTX.Pipe()
    child = CTX.Process(target=_read_until_shutdown, args=(q.export_handle(), child_end, 0.01))
    child.start()
    count = 300
    try:
        assert report.poll(30) and report.recv() == "attached"
        q.wait_until_ready(timeout=30)
        for i in range(count):
            q.enqueue_bytes(i.to_bytes(4, "little") * (1 << 14), timeout=30)
        q.close()
        child.join(60)
        assert child.exitcode == 0
        assert report.poll(0) and report.recv() == count
    finally:
        child.kill()
        child.join(30)
        q.close()
        report.close()
        child_end.close()


def test_queue_ends_opened_right_after_others_closed_can_monitor_their_sockets():
    """A queue end opened while ZeroMQ still reaps the sockets of ends just closed (a writer's lingers) gets its
    connection monitor: each monitor has an endpoint of its own (pyzmq's default, named after the socket's
    descriptor, was still taken when a new socket got the same descriptor: "Address already in use", about one
    round in six here)."""
    for _ in range(20):
        a = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
        b = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
        reader_a = MessageQueue.create_from_handle(a.export_handle(), 0)
        a.wait_until_ready(timeout=10)
        a.enqueue("to a", timeout=5)
        assert reader_a.dequeue(timeout=5) == "to a"
        reader_a.close()
        a.close()
        reader_b = MessageQueue.create_from_handle(b.export_handle(), 0)
        reader_b.close()
        b.close()


def test_a_child_forked_while_another_thread_holds_the_process_zeromq_lock_opens_remote_queues():
    """The lock around the process's ZeroMQ context is made afresh in a forked child (a thread of the parent
    may hold it at the fork; the child has no such thread)."""
    from hotloop.queue.remote.context import ProcessZmq

    with ProcessZmq._lock:
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child with SIGALRM
            try:
                MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1").close()
                os._exit(0)
            except BaseException:
                os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_the_zap_handler_survives_a_key_forgotten_between_its_two_questions():
    """The writer may close between pyzmq's credentials callback and its user-id question: the handler answers a
    rank that matches nothing instead of raising (which would end the thread that serves every queue)."""
    from hotloop.queue.remote.context import ProcessZmq

    zmq_ = ProcessZmq.acquire()
    try:
        q = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
        zap = zmq_.zap
        unknown = bytes(32)
        assert zap.curve_user_id(unknown) == "-1"
        q.close()
        assert zap.is_alive()
    finally:
        zmq_.release()


def test_a_parked_remote_reader_woken_by_a_burst_reads_it_all_once_in_order_and_parks_again():
    """A reader woken by the wait receives at once, without reading ZMQ_EVENTS first; the messages that arrived
    behind the first are still found (one look after each), and once all are read its source is quiet again
    (readable() False, the wait times out) rather than left ready with nothing to take."""
    q = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=10)
    got, errors = [], []

    def read():
        try:
            while len(got) < 200:
                got.append(bytes(r.dequeue_bytes(timeout=10)))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    for _ in range(3):  # each round: the reader parks first, then a burst wakes it
        got.clear()
        t = threading.Thread(target=read)
        t.start()
        wait_until(lambda: thread_sleeping(t), what="the reader to park")
        for i in range(200):
            q.enqueue_bytes(_payload(i), timeout=10)
        t.join(30)
        assert not t.is_alive() and not errors, errors
        assert got == [_payload(i) for i in range(200)]
        assert not r.readable()
        assert hotloop.wait_any([r], timeout=0.05) == []
        with pytest.raises(TimeoutError):
            r.dequeue_bytes(timeout=0.05)
    q.close()
    r.close()


_EXIT_SCRIPT = """
import sys
from hotloop import MessageQueue
w = MessageQueue(1, n_local_reader=0, connect_ip="127.0.0.1")
r = MessageQueue.create_from_handle(w.export_handle(), 0)
w.wait_until_ready(timeout=10)
w.enqueue_bytes(b"x" * 64)
assert bytes(r.dequeue_bytes(timeout=10)) == b"x" * 64
r.close()  # closed now, and again by MessageQueue.__del__ while the interpreter finalizes
if sys.argv[1] == "writer-open":
    w.enqueue_bytes(b"y")  # the writer is left open: closed at exit
else:
    w.close()
print("done", flush=True)
"""


@pytest.mark.parametrize("writer", ["writer-open", "writer-closed"])
def test_a_process_with_remote_queue_ends_in_module_globals_exits(writer):
    """Queue ends left in module globals are closed at exit (some twice: by close() and by __del__ while the
    interpreter finalizes); the process exits instead of hanging there."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, writer], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", (proc.returncode, proc.stdout, proc.stderr)
