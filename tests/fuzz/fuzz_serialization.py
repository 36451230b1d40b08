"""Fuzz hotloop.queue.serialization.loads: the decoder of every MessageQueue message a reader receives.

Contract checked: for any bytes, ``loads`` returns an object or raises ValueError("corrupt message: ...");
never another exception, a crash, a hang (libFuzzer -timeout), an allocation the message's bytes do not pay for
(tensors and arrays in the result larger than the message, or the peak RSS growing by more than 256 MiB), or an
error that was only printed (by C code, or "unraisable" in a destructor). Pickle runs code named by the message:
a malicious sender is out of scope (the network path is authenticated); damaged and truncated frames are in
scope. Known findings F2-F4 (tests/fuzz/README.md) are recognised before loads runs and tolerated unless
HOTLOOP_FUZZ_STRICT=1.

Input: first byte even = the rest is a message as is (the saved corpus holds valid encodings, so libFuzzer's own
mutations corrupt real frames); odd = the second byte picks one of seed_objects(), the rest is a program of
structured mutations (set byte, truncate, insert, delete, plant an interesting 32/64-bit length) applied to its
encoding.

Long run:  python tests/fuzz/fuzz_serialization.py -max_total_time=600 tests/fuzz/corpus/serialization
(new inputs are added to the first corpus directory: pass a scratch directory first to keep the saved one as is).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import sys

import numpy as np
import torch

import atheris

import _common

from hotloop.queue import serialization

# Coverage for libFuzzer: the decoder's Python code, and pickletools' opcode walker (run on every input by the
# known-finding checks below), which gives the C unpickler's opcodes a coverage signal of their own.
for _fn in (serialization.loads, serialization._unpickle, serialization._rebuild_tensor):
    atheris.instrument_func(_fn)
for _name in dir(pickletools):
    if _name.startswith(("read_", "_genops")) and callable(getattr(pickletools, _name)):
        setattr(pickletools, _name, atheris.instrument_func(getattr(pickletools, _name)))

RSS_GROWTH_MB = 256


def seed_objects() -> list:
    """Objects whose encodings are mutated (also written to the saved corpus by make_corpus.py)."""
    g = torch.Generator().manual_seed(0)
    return [
        b"hello",
        b"\x00" * 300,
        bytearray(b"abc" * 40),
        "text \u00e9\u4e2d",
        12345678901234567890,
        3.5,
        None,
        [1, 2, [3, 4]],
        {"step": 1, "ids": list(range(20)), "name": "req-1"},
        {"a": {"b": {"c": [b"x" * 70, (1, 2.0, None)]}}},
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.zeros((2, 3), dtype=np.float16),
        np.array([1.5, -2.0]),
        np.array(["a", "bc"]),
        np.arange(6)[::2],  # not contiguous
        torch.arange(10),
        torch.rand(2, 3, generator=g),
        torch.ones(4, dtype=torch.bfloat16),
        torch.empty(0, 3),
        torch.zeros(2, 2, requires_grad=True),
        torch.tensor(7),
        torch.arange(12).reshape(3, 4).t(),
        {"t": torch.arange(3, dtype=torch.uint8), "n": np.ones(3), "b": bytearray(b"zz" * 40)},
        [torch.empty(0), torch.ones(1), b"y" * 80],
    ]


def encode(obj) -> bytes:
    parts, _keep = serialization.dumps(obj)
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


SEEDS = [encode(o) for o in seed_objects()]
INTERESTING = [0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               1 << 20, 1 << 28, 1 << 31, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]


def mutate(seed: bytes, program: bytes) -> bytes:
    """Apply the mutations `program` describes (7 bytes each: op, position, value) to `seed`."""
    e = bytearray(seed)
    for i in range(0, len(program) - 6, 7):
        op = program[i] % 6
        pos = int.from_bytes(program[i + 1:i + 3], "little")
        val = int.from_bytes(program[i + 3:i + 7], "little")
        n = len(e)
        if op == 0 and n:
            e[pos % n] = val & 0xFF
        elif op == 1:
            del e[pos % (n + 1):]
        elif op == 2:
            e[pos % (n + 1):pos % (n + 1)] = val.to_bytes(4, "little")[:1 + val % 4]
        elif op == 3 and n:
            del e[pos % n:pos % n + 1 + val % 16]
        elif op == 4 and n >= 4:
            p = pos % (n - 3)
            e[p:p + 4] = (INTERESTING[val % len(INTERESTING)] & 0xFFFFFFFF).to_bytes(4, "little")
        elif op == 5 and n >= 8:
            p = pos % (n - 7)
            e[p:p + 8] = INTERESTING[val % len(INTERESTING)].to_bytes(8, "little")
    return bytes(e)


def message_from_input(data: bytes) -> bytes:
    if not data or data[0] % 2 == 0 or len(data) < 2:
        return data[1:]
    return mutate(SEEDS[data[1] % len(SEEDS)], data[2:])


def _layout(buf: bytes) -> tuple[int, int, list[int]] | None:
    """Where a message's pickle lies and its out-of-band buffers' lengths: (offset, length, lengths)."""
    if buf[:1] == bytes([serialization._PROTO]):  # a bare pickle
        return 0, len(buf), []
    if len(buf) < 12 or buf[:4] != serialization.MAGIC:
        return None
    n_buffers, n_pickle = struct.unpack_from("<II", buf, 4)
    off = 12 + 8 * n_buffers
    if off + n_pickle > len(buf):
        return None
    return off, n_pickle, list(struct.unpack_from(f"<{n_buffers}Q", buf, 12))


def _pickle_region(buf: bytes) -> bytes | None:
    layout = _layout(buf)
    return None if layout is None else buf[layout[0]:layout[0] + layout[1]]


def pickle_known_finding(buf: bytes) -> str | None:
    """Known findings in CPython's C unpickler, found by walking the pickle's opcodes:

    F3: a PUT / LONG_BINPUT memo index makes it allocate (and clear) a memo table of 2 x index pointers: five
        bytes of opcode ask for gigabytes (resident: the table is written).
    F4: BYTEARRAY8 / BINBYTES8 allocate their count before checking it against the data (a run saw the peak
        RSS grow by 567 MiB for a 343-byte message); when that allocation fails, CPython 3.11 frees a bytearray
        whose export count was never set and prints "SystemError: deallocated bytearray object has exported
        buffers" (loads still raises its ValueError).
    """
    region = _pickle_region(buf)
    if region is None:
        return None
    try:
        for op, arg, _pos in pickletools.genops(region):
            if op.name in ("PUT", "LONG_BINPUT") and isinstance(arg, int) and arg > (1 << 16):
                return "F3 pickle memo index allocates 16 bytes per index"
    except ValueError as e:  # "expected N bytes in a bytearray8, but only M remain"
        words = str(e).split()
        if words[:1] == ["expected"] and words[1].isdigit() and int(words[1]) > (1 << 20):
            return "F4 counted bytes allocated before the count is checked"
    except Exception:
        pass
    return None


class _DtypeStateCheck(pickle._Unpickler):
    """The pure-Python unpickler, stopping at a BUILD that would hand numpy.dtype.__setstate__ a state other than
    the one numpy writes for that dtype (known finding F2: numpy trusts the state's sizes and flags; e.g. the
    6-tuple (3, '<', None, -1, -208, 0) segfaults, flags 0xff make an int64 dtype "hold references" and fail when
    freed)."""

    bad = False

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, np.dtype):
            expected = inst.__reduce__()[2]
            if not (isinstance(state, tuple) and len(state) == len(expected) and state[0] == expected[0]
                    and state[2:] == expected[2:] and state[1] in ("<", ">", "=", "|")):
                self.bad = True
                raise pickle.UnpicklingError("bad dtype state")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def numpy_dtype_crash(buf: bytes) -> bool:
    layout = _layout(buf)
    if layout is None:
        return False
    off, n_pickle, lengths = layout
    region = buf[off:off + n_pickle]
    if b"dtype" not in region:
        return False
    off, oob = off + n_pickle, []
    for n in lengths:
        oob.append(memoryview(bytearray(buf[off:off + n])))
        off += n
    check = _DtypeStateCheck(io.BytesIO(region), buffers=oob)
    try:
        check.load()
    except Exception:
        pass
    return check.bad


def _result_bytes(obj, depth=0, seen=None) -> int:
    """Bytes of the arrays, tensors and byte strings an object holds (containers walked, shared ones once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 50:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_result_bytes(k, depth + 1, seen) + _result_bytes(v, depth + 1, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_result_bytes(x, depth + 1, seen) for x in obj)
    return 0


_baseline_rss = None


def check(buf: bytes) -> None:
    """Raise Finding when loads(buf) breaks the contract."""
    global _baseline_rss
    if _baseline_rss is None:
        _baseline_rss = _common.peak_rss_mb()
    what = pickle_known_finding(buf)
    if what:
        _common.known(f"{what}: {buf.hex()}")
        return
    if numpy_dtype_crash(buf):
        _common.known("F2 numpy.dtype.__setstate__ crashes on a malformed state: " + buf.hex())
        return
    try:
        obj = serialization.loads(bytearray(buf))
    except ValueError as e:
        if not str(e).startswith("corrupt message:"):
            raise _common.Finding(f"ValueError without the 'corrupt message:' prefix: {e!r}") from e
    except Exception as e:
        raise _common.Finding(f"loads raised {type(e).__name__}, not ValueError: {e!r}") from e
    else:
        size = _result_bytes(obj)
        if size > len(buf) + 4096:
            raise _common.Finding(f"a {len(buf)}-byte message decoded to {size} bytes of data")
        del obj
    if getattr(sys, "last_value", None) is not None:  # set by PyErr_Print: C code printed an error and went on
        error, sys.last_value = sys.last_value, None
        raise _common.Finding(f"an error was printed, not raised: {error!r}")
    if _common.UNRAISABLE:
        raise _common.Finding(f"an exception was raised where it could not propagate: {_common.UNRAISABLE.pop()}")
    grown = _common.peak_rss_mb() - _baseline_rss
    if grown > RSS_GROWTH_MB:
        raise _common.Finding(f"peak RSS grew by {grown} MiB decoding a {len(buf)}-byte message")


def TestOneInput(data: bytes) -> None:
    check(message_from_input(data))


if __name__ == "__main__":
    _common.run_atheris(TestOneInput)
