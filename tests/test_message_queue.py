"""hotloop.MessageQueue across processes: delivery, tensors, full ring, shutdown, dead peers, bad input, asyncio,
and no /dev/shm leftovers. Tests taking the ``backend`` fixture run over shared-memory readers and over network
readers alike (test_message_queue_remote.py has what only the network path has)."""

import asyncio
import gc
import hashlib
import inspect
import multiprocessing as mp
import os
import pickle
import random
import re
import signal
import time
from unittest import mock

import numpy as np
import pytest
from conftest import require_torch

import hotloop
from hotloop import ClosedError, DeadPeerError, MessageQueue, QueueTimeout, WaitPolicy
from hotloop.queue import serialization

CTX = mp.get_context("fork")
RING = 1 << 16  # max_chunk_bytes below gives this ring size
CHUNK = RING // 4 - 64
LOOPBACK = "127.0.0.1"


@pytest.fixture(params=["local", "remote"])
def backend(request):
    """Which reader backend the test's readers get: shared memory, or the network (TCP on loopback)."""
    return request.param


def _queue(backend: str, n_reader: int = 1, remote_ranks: int | None = None, **kw) -> MessageQueue:
    """A writer whose readers use `backend`: all local, or the last `remote_ranks` (default: all) remote."""
    if backend == "local":
        return MessageQueue(n_reader, max_chunk_bytes=kw.pop("max_chunk_bytes", CHUNK), **kw)
    n_remote = n_reader if remote_ranks is None else remote_ranks
    return MessageQueue(n_reader, n_local_reader=n_reader - n_remote, max_chunk_bytes=kw.pop("max_chunk_bytes", CHUNK),
                        connect_ip=LOOPBACK, **kw)


def _payload(seq: int) -> bytes:
    rng = random.Random(seq)
    size = rng.randrange(4 * RING + 1) if rng.random() < 0.02 else rng.randrange(2048)
    return rng.randbytes(size)


def _reader_main(handle, rank, count, slow, results):
    try:
        q = MessageQueue.create_from_handle(handle, rank)
        digest = hashlib.blake2b()
        for seq in range(count):
            msg = q.dequeue(timeout=30)
            assert msg["seq"] == seq, f"rank {rank}: got message {msg['seq']}, expected {seq}"
            assert msg["sum"] == hashlib.blake2b(msg["data"]).hexdigest(), f"rank {rank}: bad checksum at {seq}"
            digest.update(msg["data"])
            if slow and seq % 50 == 0:
                time.sleep(0.002)
        q.close()
        results.put((rank, digest.hexdigest()))
    except BaseException as e:  # report, do not hang the writer
        results.put((rank, f"error: {e!r}"))


def test_three_reader_processes_get_every_message_once_in_order():
    count = 3000
    for slow in (False, True):
        q = MessageQueue(3, max_chunk_bytes=CHUNK)
        results = CTX.Queue()
        procs = [CTX.Process(target=_reader_main, args=(q.export_handle(), r, count, slow and r == 1, results))
                 for r in range(3)]
        for p in procs:
            p.start()
        q.wait_until_ready(timeout=30)
        digest = hashlib.blake2b()
        for seq in range(count):
            data = _payload(seq)
            digest.update(data)
            q.enqueue({"seq": seq, "data": data, "sum": hashlib.blake2b(data).hexdigest()}, timeout=30)
        got = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
        q.close()
        assert got == {r: digest.hexdigest() for r in range(3)}


def _tensors():
    import torch

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "contiguous": base.clone(),
        "non_contiguous": base.t(),
        "zero_d": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "bf16": torch.linspace(-2, 2, 10, dtype=torch.bfloat16),
        "int64": torch.arange(5),
        "bool": torch.tensor([True, False]),
        "np": np.arange(12, dtype=np.float64).reshape(3, 4),
        "np_non_contiguous": np.arange(12).reshape(3, 4)[:, ::2],
        "np_empty": np.zeros((0,), dtype=np.int32),
        "bytes": b"\x00\x01" * 1000,
    }


def test_tensors_and_arrays_round_trip_and_do_not_alias_the_ring():
    torch = require_torch()
    with MessageQueue(1, max_chunk_bytes=CHUNK) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        sent = _tensors()
        expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v)
                    for k, v in sent.items()}
        q.enqueue(sent)
        sent["contiguous"].fill_(-1)  # mutating the original after enqueue changes nothing for readers
        sent["np"][:] = -1
        got = r.dequeue(timeout=5)
        for k, v in expected.items():
            if isinstance(v, torch.Tensor):
                assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
            elif isinstance(v, np.ndarray):
                assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
            else:
                assert got[k] == v
        # later messages reuse the ring; what the reader holds must not change
        for _ in range(20):
            q.enqueue({"contiguous": torch.full((4, 6), 7.0)})
            r.dequeue(timeout=5)
        assert torch.equal(got["contiguous"], expected["contiguous"])
        got["contiguous"].add_(1)  # the reader's tensors are its own, writable
        r.close()


def test_object_path_round_trips_every_kind_of_message_in_order(backend):
    """The object path pickles and writes in one call and unpickles in ring memory: falsy objects (None is a
    message, not a timeout), a pickle spanning several records, out-of-band buffers between bare pickles, a
    corrupt message (a clear error, and the next message intact), all in order."""
    big = list(range(CHUNK // 2))  # a bare pickle larger than one record (~24 KiB), smaller than the ring
    oob = pickle.PickleBuffer(bytearray(b"b" * 5000))
    messages = [None, 0, False, "", (), {"k": [1, 2.5, "x"]}, big, {"buf": oob}, b"tail", [oob]]  # 2 with buffers
    with _queue(backend) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.wait_until_ready(30)
        for m in messages[:3]:
            q.enqueue(m)
        q.enqueue_bytes(b"\x80\x05garbage that is not a pickle")
        for m in messages[3:]:
            if m == b"tail":  # a pickling error between two messages with buffers loses nothing
                with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
                    q.enqueue([oob, lambda: 1])
            q.enqueue(m, timeout=30)
        assert [r.dequeue(timeout=30) for _ in range(3)] == [None, 0, False]
        with pytest.raises(ValueError, match="corrupt message"):
            r.dequeue(timeout=30)
        got = [r.dequeue(timeout=30) for _ in range(len(messages) - 3)]
        assert got[:4] == ["", (), {"k": [1, 2.5, "x"]}, big]
        assert bytes(got[4]["buf"]) == b"b" * 5000 and got[5] == b"tail" and bytes(got[6][0]) == b"b" * 5000
        with pytest.raises(QueueTimeout):
            r.dequeue(timeout=0.01)
        r.close()


def test_enqueue_and_dequeue_have_the_documented_signatures():
    """The calls a queue binds in place of enqueue/dequeue (C++) answer inspect.signature with the parameters the
    docs name, and unittest.mock's autospec of a queue works with them."""
    with MessageQueue(1, max_chunk_bytes=CHUNK) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        assert type(q.enqueue) is hotloop._core.ObjectWriter and type(r.dequeue) is hotloop._core.ObjectReader
        for call, names in ((q.enqueue, ["obj", "timeout"]), (r.dequeue, ["timeout"]),
                            (MessageQueue.enqueue, ["self", "obj", "timeout"])):
            params = inspect.signature(call).parameters
            assert list(params) == names and params["timeout"].default is None, call
        sent = {"step": 1}
        fake_writer, fake_reader = mock.create_autospec(q), mock.create_autospec(r)
        fake_writer.enqueue(sent, timeout=1.0)
        fake_writer.enqueue.assert_called_once_with(sent, timeout=1.0)
        fake_reader.dequeue.return_value = sent
        assert fake_reader.dequeue(timeout=2.0) is sent
        fake_reader.dequeue.assert_called_once_with(timeout=2.0)
        fake_call = mock.create_autospec(q.enqueue)
        fake_call(sent)
        fake_call.assert_called_once_with(sent)
        # the class's autospec checks the arguments
        fake = mock.create_autospec(MessageQueue, instance=True)
        fake.enqueue(sent, timeout=1.0)
        with pytest.raises(TypeError):
            fake.enqueue(sent, 1.0, "extra")
        # the queue itself still works
        q.enqueue(sent)
        assert r.dequeue(timeout=5) == sent
        r.close()


def test_bytes_path_and_zero_copy_view():
    with MessageQueue(1, max_chunk_bytes=CHUNK) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.enqueue_bytes(b"raw message")
        assert bytes(r.dequeue_bytes(timeout=5)) == b"raw message"
        q.enqueue_bytes(memoryview(b"x" * 1000))
        with r.acquire_read(timeout=5) as view:
            assert view.readonly and view.nbytes == 1000 and view[:3].tobytes() == b"xxx"
        with pytest.raises(ValueError):  # released at the end of the block
            view[0]
        with pytest.raises(QueueTimeout):
            with r.acquire_read(timeout=0.01):
                pass
        r.close()


def test_full_ring_times_out_naming_the_slow_reader_and_shutdown_wakes_readers():
    q = MessageQueue(2, max_chunk_bytes=1000)  # a 4 KiB ring
    fast = MessageQueue.create_from_handle(q.export_handle(), 0)
    slow = MessageQueue.create_from_handle(q.export_handle(), 1)
    q.wait_until_ready(timeout=5)
    with pytest.raises(QueueTimeout, match=r"reader rank 1 \(pid \d+\) is \d+ bytes behind"):
        for _ in range(100):
            q.enqueue_bytes(b"x" * 900, timeout=0.05)
            fast.dequeue_bytes(timeout=0)
    behind = 0
    while slow.readable():
        slow.dequeue_bytes(timeout=0)
        behind += 1
    assert behind > 0
    t0 = time.monotonic()
    import threading

    threading.Timer(0.05, q.shutdown).start()
    with pytest.raises(ClosedError, match="shut down"):
        fast.dequeue_bytes(timeout=10)  # parked, woken by shutdown
    assert time.monotonic() - t0 < 2
    with pytest.raises(ClosedError):
        q.enqueue(1)
    for x in (q, fast, slow):
        x.close()


def _attach_and_hang(handle, rank):
    reader = MessageQueue.create_from_handle(handle, rank)  # held (not read from) until killed
    time.sleep(60)
    reader.close()


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_killed_reader_raises_within_a_second_or_is_dropped(backend, policy):
    """Rank 1 (shared memory, or the network) is SIGKILLed while rank 0 (shared memory) keeps reading."""
    q = _queue(backend, 2, remote_ranks=1, dead_reader=policy)
    live = MessageQueue.create_from_handle(q.export_handle(), 0)
    p = CTX.Process(target=_attach_and_hang, args=(q.export_handle(), 1))
    p.start()
    q.wait_until_ready(timeout=10)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    t0 = time.monotonic()
    sent = 0
    pad = bytes(64)  # ~128 B records: the dead reader's part of the ring fills in ~500 messages, whatever the encoding
    try:
        while time.monotonic() - t0 < 2:
            q.enqueue({"i": sent, "pad": pad}, timeout=5)
            assert live.dequeue(timeout=1) == {"i": sent, "pad": pad}
            sent += 1
            time.sleep(0.001)
    except DeadPeerError as e:
        assert policy == "raise", e
        assert re.search(rf"reader rank 1 \(pid {p.pid}\).*died|remote reader rank 1 disconnected", str(e)), e
        assert time.monotonic() - t0 < 1.5
        assert not live.readable(), "the failed enqueue reached a local reader"
    else:
        assert policy == "drop"
    q.close()
    live.close()


def _writer_then_die(conn, backend):
    q = _queue(backend)
    conn.send(q.export_handle())
    q.wait_until_ready(timeout=10)
    q.enqueue("last words")
    conn.recv()  # the reader has it (ZeroMQ sends from its own thread: a kill right after enqueue may beat it)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_writer_is_detected_by_a_parked_reader_and_leaves_no_segment(backend):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_writer_then_die, args=(child, backend))
    p.start()
    r = MessageQueue.create_from_handle(parent.recv(), 0)
    assert r.dequeue(timeout=10) == "last words"
    parent.send("die")
    t0 = time.monotonic()
    with pytest.raises(DeadPeerError, match="writer .* died|lost the connection to its writer"):
        r.dequeue(timeout=10)
    assert time.monotonic() - t0 < 1.5
    p.join()
    r.close()
    parent.close()
    child.close()


def test_bad_input_gives_clear_errors_and_loses_nothing():
    q = MessageQueue(2, max_chunk_bytes=1000, max_message_bytes=5000)
    h = q.export_handle()
    with pytest.raises(hotloop.BadHandleError, match="out of range"):
        MessageQueue.create_from_handle(h, 2)
    r0 = MessageQueue.create_from_handle(h, 0)
    with pytest.raises(hotloop.BadHandleError, match="already attached"):
        MessageQueue.create_from_handle(h, 0)
    import dataclasses

    forged = dataclasses.replace(h, capacity=h.capacity * 2)
    with pytest.raises(hotloop.BadHandleError, match="corrupt or from another queue"):
        MessageQueue.create_from_handle(forged, 1)
    with pytest.raises(hotloop.BadHandleError, match="version 99"):
        MessageQueue.create_from_handle(dataclasses.replace(h, version=99), 1)
    with pytest.raises(hotloop.BadHandleError, match="no shared-memory segment"):
        MessageQueue.create_from_handle(dataclasses.replace(h, name="/hotloop-gone"), 1)
    with pytest.raises(hotloop.BadHandleError):
        MessageQueue.create_from_handle("not a handle", 1)
    r1 = MessageQueue.create_from_handle(h, 1)
    with pytest.raises(ValueError, match="exceeds the maximum of 5000 bytes"):
        q.enqueue_bytes(b"z" * 6000)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        q.enqueue({"fn": lambda: 1})
    q.enqueue("after the errors")
    assert r0.dequeue(timeout=5) == "after the errors" and r1.dequeue(timeout=5) == "after the errors"
    assert not r0.readable()
    with pytest.raises(QueueTimeout):
        r0.dequeue(timeout=0.01)
    for x in (q, r0, r1):
        x.close()
    with pytest.raises(ClosedError):
        q.enqueue(1)


def test_every_wait_for_a_message_that_runs_out_raises_one_queue_timeout(backend):
    """dequeue (the bound C++ call or the method), dequeue_bytes, acquire_read and dequeue_async raise the same
    QueueTimeout, a TimeoutError (what vLLM catches), worded once (message_queue.no_message); so do the writer's
    waits for readers to attach."""
    from hotloop.queue.message_queue import no_message

    assert issubclass(QueueTimeout, TimeoutError) and hotloop.errors.QueueTimeout is QueueTimeout
    with _queue(backend) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.wait_until_ready(timeout=10)
        expected = str(no_message(q.name, 0.01))
        assert f"queue {q.name}: no message within 0.01 s" in expected

        async def dequeue_async():
            await r.dequeue_async(timeout=0.01)

        def acquire_read():
            with r.acquire_read(timeout=0.01):
                pass

        waits = {"dequeue": lambda: r.dequeue(timeout=0.01),
                 "MessageQueue.dequeue": lambda: MessageQueue.dequeue(r, timeout=0.01),
                 "dequeue_bytes": lambda: r.dequeue_bytes(timeout=0.01), "acquire_read": acquire_read,
                 "dequeue_async": lambda: asyncio.run(dequeue_async())}
        for what, wait in waits.items():
            with pytest.raises(QueueTimeout) as raised:
                wait()
            assert str(raised.value) == expected, what
        q.enqueue("still delivered after the timeouts")
        assert r.dequeue(timeout=5) == "still delivered after the timeouts"
        r.close()
    with _queue(backend, n_reader=2) as q:  # rank 1 never attaches
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        with pytest.raises(QueueTimeout, match="1 of 2 .*readers attached within 0.05 s"):
            q.wait_until_ready(timeout=0.05)
        r.close()


def test_a_readers_call_on_the_writer_and_enqueue_on_a_reader_say_which_side_may_make_them(backend):
    with _queue(backend) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.wait_until_ready(timeout=10)

        def acquire_read():
            with q.acquire_read(timeout=0.01):
                pass

        calls = {"dequeue()": lambda: q.dequeue(timeout=0.01), "dequeue_bytes()": lambda: q.dequeue_bytes(0.01),
                 "readable()": q.readable, "acquire_read()": acquire_read,
                 "dequeue_async()": lambda: asyncio.run(q.dequeue_async(timeout=0.01))}
        for what, call in calls.items():
            with pytest.raises(RuntimeError, match=re.escape(f"queue {q.name}: {what} is a reader's call and this "
                                                             "is the queue's writer")) as raised:
                call()
            assert "MessageQueue.create_from_handle(writer.export_handle(), rank)" in str(raised.value)
        with pytest.raises(AttributeError, match="the writer has no hotloop_source"):
            q.hotloop_source
        assert not hasattr(q, "hotloop_source")  # so code that asks hasattr() sees no source
        with pytest.raises(TypeError, match="MessageQueue reader"):
            hotloop.wait_any([q], timeout=0)
        assert isinstance(q.wait_stats, (dict, type(None)))  # the writer's own waits: a writer's call too
        for send in (r.enqueue, r.enqueue_bytes):
            with pytest.raises(RuntimeError, match="reader rank 0 cannot enqueue; only the writer can"):
                send(b"x")
        q.enqueue("the queue still works")
        assert r.dequeue(timeout=5) == "the queue still works"
        r.close()


def test_readers_are_wait_any_sources_and_readable_never_blocks(backend):
    with _queue(backend) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.wait_until_ready(timeout=10)
        inputs = hotloop.InputQueue()
        t0 = time.monotonic()
        assert not r.readable()
        assert hotloop.wait_any([r, inputs], timeout=0.05) == []
        assert time.monotonic() - t0 < 1
        q.enqueue("hello")
        assert hotloop.wait_any([r, inputs], timeout=5) == [r]
        assert r.readable()
        assert r.dequeue(timeout=0) == "hello"
        q.enqueue_bytes(b"raw")
        with r.acquire_read(timeout=5) as view:
            assert bytes(view) == b"raw"
        r.close()


def test_a_prepared_waiter_over_a_reader_sees_every_buffered_message_and_sleeps_when_empty(backend):
    """A Waiter takes its sources once: a reader's source must stay right between calls, whether the next message
    is in the ring, buffered in a network reader, still in ZeroMQ, or not sent yet."""
    q = _queue(backend)
    reader = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=10)
    waiter = hotloop.Waiter([reader])
    for burst in (1, 5, 50):
        for i in range(burst):
            q.enqueue(i, timeout=5)
        got = []
        while len(got) < burst:
            assert waiter.wait(timeout=5), f"slept through message {len(got)} of a burst of {burst}"
            got.append(reader.dequeue(timeout=0))
        assert got == list(range(burst))
        assert waiter.wait(timeout=0.2) == [], "ready with nothing to read"
    q.close()
    reader.close()


def test_dequeue_async_many_concurrent_readers_woken_by_the_writer_idle_at_no_cpu(backend):
    n = 4
    q = _queue(backend, n)
    readers = [MessageQueue.create_from_handle(q.export_handle(), i) for i in range(n)]
    q.wait_until_ready(timeout=10)

    async def main():
        async def consume(r):
            return [await r.dequeue_async(timeout=10) for _ in range(50)]

        tasks = [asyncio.create_task(consume(r)) for r in readers]
        await asyncio.sleep(0)
        assert not any(t.done() for t in tasks)
        for i in range(50):
            q.enqueue(i)
            await asyncio.sleep(0)
        got = await asyncio.gather(*tasks)
        assert all(g == list(range(50)) for g in got)
        # idle: every reader awaits a message that does not come
        c0, t0 = time.process_time(), time.monotonic()
        with pytest.raises(QueueTimeout):
            await asyncio.gather(*(r.dequeue_async(timeout=1.0) for r in readers))
        return (time.process_time() - c0) / (time.monotonic() - t0)

    cpu = asyncio.run(main())
    assert cpu < 0.05, f"asyncio readers used {cpu:.1%} of a core while idle"
    for x in (q, *readers):
        x.close()


def test_no_lost_wake_up_between_publish_and_park():
    q = MessageQueue(1, max_chunk_bytes=CHUNK, policy=WaitPolicy(spin_us=0, yield_us=0))
    back = MessageQueue(1, max_chunk_bytes=CHUNK, policy=WaitPolicy(spin_us=0, yield_us=0))
    park = WaitPolicy(spin_us=0, yield_us=0)
    rounds = 3000

    def echo(h_in, h_out):
        r = MessageQueue.create_from_handle(h_in, 0, policy=park)
        w = back  # the inherited writer
        for _ in range(rounds):
            w.enqueue_bytes(r.dequeue_bytes(timeout=5), timeout=5)

    p = CTX.Process(target=echo, args=(q.export_handle(), back.export_handle()))
    p.start()
    r = MessageQueue.create_from_handle(back.export_handle(), 0, policy=park)
    for i in range(rounds):
        q.enqueue_bytes(i.to_bytes(4, "little"), timeout=5)
        assert int.from_bytes(r.dequeue_bytes(timeout=5), "little") == i, f"lost wake-up at round {i}"
    p.join(10)
    assert p.exitcode == 0
    for x in (q, back, r):
        x.close()


def _close_inherited(q, r):
    q.close()  # copies inherited through fork: closing them here must not touch the parent's queue
    r.close()


def test_closing_inherited_copies_in_a_forked_child_leaves_the_parents_queue_alone():
    q = MessageQueue(1, max_chunk_bytes=1000)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    p = CTX.Process(target=_close_inherited, args=(q, r))
    p.start()
    p.join(10)
    assert p.exitcode == 0
    for _ in range(20):  # nothing was shut down
        q.enqueue_bytes(b"m" * 900, timeout=5)
        assert bytes(r.dequeue_bytes(timeout=5)) == b"m" * 900
    assert not q._local.shut_down
    with pytest.raises(QueueTimeout, match="reader rank 0"):  # the reader still holds the writer back
        for _ in range(10):
            q.enqueue_bytes(b"m" * 900, timeout=0.05)
    q.close()
    r.close()


def test_shared_memory_enqueue_and_dequeue_are_one_call_unless_a_subclass_overrides_them():
    """A queue whose only side is shared memory binds enqueue/dequeue to its ring (one C++ call per message,
    timeouts still name the queue); a subclass's own enqueue/dequeue are kept, and they reach the same ring."""
    from hotloop import _core

    class Counting(MessageQueue):
        calls = 0

        def dequeue(self, timeout=None):
            Counting.calls += 1
            return super().dequeue(timeout)

    with MessageQueue(1) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        assert isinstance(q.enqueue, _core.ObjectWriter) and isinstance(r.dequeue, _core.ObjectReader)
        q.enqueue({"k": 1})
        q.enqueue(None, timeout=1)
        assert r.dequeue() == {"k": 1} and r.dequeue(timeout=1) is None
        with pytest.raises(QueueTimeout, match=f"queue {q.name}: no message within 0.01 s"):
            r.dequeue(timeout=0.01)
        r.close()
    with Counting(1) as q:
        r = Counting.create_from_handle(q.export_handle(), 0)
        assert isinstance(q.enqueue, _core.ObjectWriter) and not isinstance(r.dequeue, _core.ObjectReader)
        q.enqueue("via the subclass")
        assert r.dequeue(timeout=5) == "via the subclass" and Counting.calls == 1
        r.close()
    # The bound calls keep their ring open as bound methods kept the queue; the queue's last reference closes it.
    q = MessageQueue(1)
    recv = MessageQueue.create_from_handle(q.export_handle(), 0).dequeue
    send = q.enqueue
    del q
    gc.collect()
    send(b"kept")
    assert recv(timeout=5) == b"kept"
    del send
    with pytest.raises(ClosedError):
        recv(timeout=5)  # the writer's last reference went: shut down, and the reader is told
    with pytest.raises(TypeError, match="ring must be a ShmRing"):
        _core.ObjectReader(object(), _core.WaitPolicy(), serialization.OBJECT_LOADERS, "q")


def test_a_reader_dropped_without_close_leaves_even_when_its_wait_source_is_still_held():
    """Dropping a reader queue detaches it (the writer goes on past a full ring) unless the caller kept its bound
    dequeue; a wait source over it, kept somewhere, does not keep it attached."""
    q = MessageQueue(1, max_chunk_bytes=1024)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    source = r.hotloop_source
    del r
    gc.collect()
    for _ in range(200):  # many times the ring
        q.enqueue(b"x" * 512, timeout=5)
    del source
    q.close()


def test_a_patched_enqueue_is_called():
    """unittest.mock.patch.object(MessageQueue, "enqueue") replaces what queues made under it call."""
    from unittest import mock

    with mock.patch.object(MessageQueue, "enqueue") as patched:
        q = MessageQueue(1)
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.enqueue("hi")
        assert patched.called and not r.readable()
        r.close()
        q.close()
