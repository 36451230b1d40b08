"""hotloop.queue.serialization: an object without large buffers is one part, the bare pickle; large buffers still go
out-of-band and the reader's objects point into its own copy; a failed dumps leaves the per-thread pickler clean
and nothing is kept alive; threads pickle concurrently."""

import gc
import pickle
import threading
import weakref

import numpy as np
import pytest
from conftest import require_torch

from hotloop import MessageQueue
from hotloop.queue import serialization

CHUNK = 1 << 17  # records of 128 KiB in a ring of 512 KiB or more: larger messages are split across records


class Box:
    """A picklable object a weak reference can watch."""


def _joined(parts) -> bytearray:
    return bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))


def test_an_object_without_large_buffers_is_one_part_the_bare_pickle():
    obj = {"step": 3, "ids": [1, 2, 3], "payload": b"x" * 64, "name": "req-1"}
    parts, keep_alive = serialization.dumps(obj)
    assert len(parts) == 1 and not keep_alive
    assert bytes(parts[0]) == pickle.dumps(obj, protocol=5)
    for buf in (parts[0], bytearray(parts[0]), memoryview(parts[0]), memoryview(bytearray(parts[0])).cast("c")):
        assert serialization.loads(buf) == obj


def test_a_pickle_over_64_kib_arrives_whole_through_the_queue():
    obj = ["a" * 100_000, b"b" * 200_000, bytearray(b"c" * 70_000), list(range(20_000))]
    parts, _ = serialization.dumps(obj)
    assert serialization.loads(_joined(parts)) == obj
    with MessageQueue(1, max_chunk_bytes=CHUNK) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)
        q.enqueue(obj, timeout=5)
        assert r.dequeue(timeout=5) == obj
        r.close()


def test_large_buffers_go_out_of_band_and_point_into_the_readers_copy():
    arr = np.arange(1000, dtype=np.int64)
    obj = {"a": arr, "raw": pickle.PickleBuffer(bytearray(b"q" * 100)), "small": 7}
    parts, _ = serialization.dumps(obj)
    assert bytes(parts[0][:4]) == serialization.MAGIC and len(parts) == 4  # header, pickle, two buffers
    msg = _joined(parts)
    got = serialization.loads(msg)
    assert np.array_equal(got["a"], arr) and bytes(got["raw"]) == b"q" * 100 and got["small"] == 7
    start = np.frombuffer(msg, dtype=np.uint8).ctypes.data
    assert start <= got["a"].ctypes.data < start + len(msg)  # zero-copy: the array lies in the message


def test_a_tensor_goes_out_of_band_and_is_kept_alive_until_written():
    torch = require_torch()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    parts, keep_alive = serialization.dumps({"t": t})
    assert bytes(parts[0][:4]) == serialization.MAGIC and len(parts) == 3 and len(keep_alive) == 1
    assert torch.equal(serialization.loads(_joined(parts))["t"], t)


# A 2x2 int32 tensor as dumps() wrote it when the tensor wire name was fixed (HLM1 header, the pickle calling
# hotloop.queue.serialization._rebuild_tensor, the tensor's 16 bytes out-of-band). Do not regenerate it to make
# the test below pass: a failure means tensor messages changed format.
TENSOR_MESSAGE = bytes.fromhex(
    "484c4d310100000053000000100000000000000080059548000000000000008c1b686f746c6f6f702e71756575652e73657269616c69"
    "7a6174696f6e948c0f5f72656275696c645f74656e736f7294939428978c05696e743332944b024b02869489749452942e0000000001"
    "0000000200000003000000")


def _globals_named(pickled: bytes) -> list[tuple[str, str]]:
    """The (module, name) of every global a pickle imports (STACK_GLOBAL after its two strings)."""
    import pickletools

    strings, named = [], []
    for op, arg, _pos in pickletools.genops(pickled):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            named.append((strings[-2], strings[-1]))
    return named


def test_the_tensor_wire_name_is_stable_and_imports():
    """A tensor's messages name serialization.WIRE_NAME, on purpose: the name still imports to the function, a
    message made with it loads, and a tensor's message today names it (a moved function fails here, not in a
    reader of another process)."""
    import importlib

    module, name = serialization.WIRE_NAME
    assert (module, name) == ("hotloop.queue.serialization", "_rebuild_tensor")
    assert getattr(importlib.import_module(module), name) is serialization._rebuild_tensor
    require_torch()
    import torch

    t = serialization.loads(bytearray(TENSOR_MESSAGE))
    assert t.dtype == torch.int32 and t.tolist() == [[0, 1], [2, 3]]
    parts, keep_alive = serialization.dumps(torch.arange(4, dtype=torch.int32).reshape(2, 2))
    today = _joined(parts)  # copied while keep_alive holds the tensor the parts point into
    del parts, keep_alive
    assert today[:4] == serialization.MAGIC
    pickle_start = 12 + 8 * int.from_bytes(today[4:8], "little")
    pickled = bytes(today[pickle_start:pickle_start + int.from_bytes(today[8:12], "little")])
    assert _globals_named(pickled) == [serialization.WIRE_NAME]
    assert serialization.loads(today).tolist() == [[0, 1], [2, 3]]


def test_a_failed_dumps_leaves_the_next_message_clean_and_keeps_nothing_alive():
    box = Box()
    ref = weakref.ref(box)
    # a 200 KB chunk and an out-of-band buffer are out before the lambda fails
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        serialization.dumps([box, b"x" * 200_000, np.ones(10), lambda: 1])
    parts, keep_alive = serialization.dumps("next")
    assert parts == (pickle.dumps("next", protocol=5),) and not keep_alive
    serialization.dumps([box, box])  # memoized twice: the memo must not outlive the message
    del box
    gc.collect()
    assert ref() is None


def test_corrupt_messages_raise_value_error():
    with pytest.raises(ValueError, match="corrupt message: cannot unpickle"):
        serialization.loads(b"\x80\x05garbage")
    with pytest.raises(ValueError, match="corrupt message: cannot unpickle"):
        serialization.loads(pickle.dumps(pickle.PickleBuffer(b"x" * 10), protocol=5, buffer_callback=lambda b: False))
    with pytest.raises(ValueError, match="bad magic .* read it with dequeue_bytes"):
        serialization.loads(b"raw message bytes")
    with pytest.raises(ValueError, match="shorter than a message header"):
        serialization.loads(b"")


def test_threads_pickle_concurrently_each_with_its_own_pickler():
    errors = []

    def work(i):
        for j in range(2000):
            obj = {"thread": i, "j": j, "data": [i] * (j % 50), "arr": np.full(j % 3, i) if j % 7 == 0 else None}
            parts, _ = serialization.dumps(obj)
            got = serialization.loads(_joined(parts))
            if got["thread"] != i or got["j"] != j or got["data"] != obj["data"]:
                errors.append((i, j))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_queue_writer_threads_taking_turns_each_pickle_with_their_own_pickler():
    """The object path finds the calling thread's pickler in C++: threads that take turns writing one queue
    (bare pickles and messages with buffers mixed, the fallback path then assembling that same thread's parts)
    deliver every message intact and in order, and each thread's pickler is the one serialization.encoder()
    gives that thread."""
    n_threads, per_thread = 4, 300
    lock, order, errors, encoders = threading.Lock(), [], [], {}
    with MessageQueue(1, max_chunk_bytes=CHUNK) as q:
        r = MessageQueue.create_from_handle(q.export_handle(), 0)

        def work(i):
            encoders[i] = serialization.encoder()
            for j in range(per_thread):
                obj = {"thread": i, "j": j, "arr": np.full(3000, i) if j % 5 == 0 else None}
                with lock:
                    q.enqueue(obj, timeout=30)
                    order.append((i, j))
                    got = r.dequeue(timeout=30)
                if (got["thread"], got["j"]) != (i, j) or (j % 5 == 0 and not (got["arr"] == i).all()):
                    errors.append((i, j, got["thread"], got["j"]))
            if serialization.encoder() is not encoders[i]:
                errors.append((i, "encoder changed"))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(order) == n_threads * per_thread
        assert len({id(e) for e in encoders.values()}) == n_threads
        r.close()


def test_a_tensor_sent_after_torch_is_imported_goes_out_of_band():
    """A process that sent objects before importing torch still sends tensors hotloop's way (out-of-band, one
    copy), through the object path's per-thread pickler, and reads them back."""
    import subprocess
    import sys

    require_torch()
    code = """
import sys
from hotloop import MessageQueue
from hotloop.queue import serialization
assert "torch" not in sys.modules
q = MessageQueue(1, max_chunk_bytes=1 << 17)
r = MessageQueue.create_from_handle(q.export_handle(), 0)
q.enqueue("before torch")
assert r.dequeue(timeout=5) == "before torch"
import torch
t = torch.arange(5000, dtype=torch.float32)
q.enqueue({"t": t})
raw = bytes(r.dequeue_bytes(timeout=5))
assert raw[:4] == serialization.MAGIC, raw[:4]
assert torch.equal(serialization.loads(bytearray(raw))["t"], t)
r.close(); q.close()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _live_encoders() -> int:
    return sum(type(o) is serialization._Encoder for o in gc.get_objects())


def test_a_thread_that_sent_messages_leaves_no_pickler_behind_when_it_ends():
    """Each thread's pickler goes with the thread (nothing it holds refers back to it: the native sink is not
    seen by the garbage collector, so such a cycle would stay forever)."""
    q = MessageQueue(1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)

    def send():
        q.enqueue({"from": threading.get_ident()})

    gc.collect()
    before = _live_encoders()
    for _ in range(50):
        t = threading.Thread(target=send)
        t.start()
        t.join()
        r.dequeue(timeout=5)
    gc.collect()
    assert _live_encoders() <= before + 1
    r.close()
    q.close()


def test_an_encoder_is_freed_by_reference_counting_alone():
    """No reference cycle through an encoder, with torch's reducer registered too (the collector cannot break
    one that passes through the native sink)."""
    require_torch()
    gc.collect()
    before = _live_encoders()
    gc.disable()
    try:
        for _ in range(10):
            enc = serialization._Encoder()
            enc.register_torch()
            del enc
        assert _live_encoders() == before
    finally:
        gc.enable()
