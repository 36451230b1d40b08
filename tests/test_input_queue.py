"""InputQueue from Python: producers on many threads, blocking gets, drain, close, references."""

import gc
import queue
import threading
import time
import weakref

import pytest

import hotloop
from hotloop import InputQueue, wait_any


def test_fifo_get_nowait_drain_len():
    q = InputQueue()
    assert len(q) == 0 and q.empty()
    for i in range(10):
        q.put(i)
    assert len(q) == 10 and q.qsize() == 10
    assert q.get_nowait() == 0
    assert q.get() == 1
    assert q.drain(max_items=3) == [2, 3, 4]
    assert q.drain(max_items=0) == []
    assert q.drain() == [5, 6, 7, 8, 9]
    assert q.drain() == []
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(ValueError):
        q.drain(max_items=-1)


def test_get_timeout_raises_queue_empty_in_time():
    q = InputQueue()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < 0.2
    with pytest.raises(ValueError, match="timeout"):
        q.get(timeout=-0.1)


def test_blocked_get_wakes_on_put():
    q = InputQueue()
    t = threading.Timer(0.05, lambda: q.put("hello"))
    t.start()
    assert q.get(timeout=5) == "hello"
    t.join()


def test_close_rejects_puts_keeps_items_and_wakes_a_blocked_get():
    q = InputQueue()
    q.put("kept")
    q.close()
    assert q.closed
    with pytest.raises(hotloop.ClosedError, match="closed"):
        q.put("rejected")
    assert q.get_nowait() == "kept", "items queued before close are not lost"
    with pytest.raises(hotloop.ClosedError):
        q.get_nowait()
    assert wait_any([q], timeout=0) == [q], "a closed queue is ready, so waiters wake"

    q2 = InputQueue()
    t = threading.Timer(0.05, q2.close)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(hotloop.ClosedError):
        q2.get()
    assert time.monotonic() - t0 < 2
    t.join()


def test_many_producers_every_item_once_in_producer_order():
    q = InputQueue()
    producers, per_producer = 8, 20_000

    def produce(p):
        for i in range(per_producer):
            q.put((p, i))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    next_seq = [0] * producers
    received = 0
    while received < producers * per_producer:
        assert wait_any([q], timeout=10), f"consumer stalled after {received} items"
        for p, i in q.drain(max_items=100):
            assert i == next_seq[p], f"producer {p}: expected {next_seq[p]}, got {i} (lost, duplicated or reordered)"
            next_seq[p] += 1
            received += 1
    for t in threads:
        t.join()
    assert q.drain() == []
    assert next_seq == [per_producer] * producers


def test_queue_holds_references_and_releases_them():
    class Item:
        pass

    q = InputQueue()
    item = Item()
    ref = weakref.ref(item)
    q.put(item)
    del item
    gc.collect()
    assert ref() is not None, "a queued object stays alive"
    got = q.get_nowait()
    assert ref() is got
    del got
    gc.collect()
    assert ref() is None

    leftover = Item()
    ref2 = weakref.ref(leftover)
    q.put(leftover)
    del leftover, q
    gc.collect()
    assert ref2() is None, "destroying a queue releases what it still held"


def test_none_is_an_item_like_any_other():
    q = InputQueue()
    q.put(None)
    q.put_nowait(None)
    assert q.get(timeout=1) is None and q.get_nowait() is None
