"""Message serialization for hotloop.MessageQueue: pickle protocol 5 with out-of-band buffers.

``dumps(obj)`` returns the parts of one message. An object without large buffers (the common case: requests,
scheduler outputs, RPC tuples) is one part, the bare pickle stream, made by a pickler kept per thread: nothing is
allocated per message beyond the pickle's bytes. An object holding large buffers (numpy arrays,
``bytes``/``bytearray`` via PickleBuffer, CPU torch tensors) becomes a small header, the pickle stream, then every
buffer as it is in memory. The ring copies the parts once into shared memory, so a tensor costs one copy on write.
``loads(buffer)`` rebuilds the object with its arrays and tensors pointing into `buffer`: pass a buffer the caller
owns (the queue hands each reader its own copy), never ring memory that will be reused.

Shared memory takes a shorter way for the same formats: ``ShmRing.write_object`` pickles with the thread's
pickler (``encoder()``'s, found in C++ through ``THREAD_PICKLERS``) and writes a bare pickle in the same call
(``assemble`` finishes any other message); ``ShmRing.read_object`` unpickles a bare pickle that fits one record
in ring memory, before releasing the record (``pickle.loads`` keeps nothing of its input), and hands anything
else to ``loads`` as a copy.

Formats: a bare pickle starts with the PROTO opcode (0x80); a message with buffers starts with the header
``<4s I I`` magic ``HLM1``, number of out-of-band buffers, pickle length, then one ``<Q`` length per buffer. A
CPU tensor is pickled as a call of ``WIRE_NAME`` (``hotloop.queue.serialization._rebuild_tensor``), kept stable.

Errors: ``loads`` raises ValueError (message "corrupt message: ...") for anything that is not one whole message
(short, bad magic, lengths that do not add up, a tensor whose metadata does not match its bytes) and for a pickle
that cannot be rebuilt; the pickle's own exception (UnpicklingError, EOFError, ImportError, ...) is chained as
``__cause__``. Unpickling runs code named by the message: only read messages from a trusted writer.
"""

from __future__ import annotations

import copyreg
import ctypes
import pickle
import struct
import sys
import threading

from hotloop import _core

MAGIC = b"HLM1"
_PROTO = pickle.PROTO[0]  # the first byte of every pickle of protocol >= 2
_pickle_loads = pickle.loads
_HEAD = struct.Struct("<4sII")


def _rebuild_tensor(buf, dtype_name: str, shape: tuple, requires_grad: bool):
    import torch

    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"corrupt message: tensor dtype {dtype_name!r} is not a torch dtype")
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"corrupt message: tensor shape {shape!r} is not a tuple of sizes")
    numel = 1
    for d in shape:
        numel *= d
    if buf is None:
        if numel != 0:  # only an empty tensor travels without bytes: never allocate what the message lacks
            raise ValueError(f"corrupt message: tensor of shape {shape} has no data")
        t = torch.empty(shape, dtype=dtype)
    else:
        nbytes = memoryview(buf).nbytes
        if nbytes != numel * dtype.itemsize or nbytes == 0:
            raise ValueError(f"corrupt message: tensor of shape {shape} and dtype {dtype_name} needs "
                             f"{numel * dtype.itemsize} bytes, the message holds {nbytes}")
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


# The wire name of a tensor: every message holding a CPU tensor names _rebuild_tensor by this module and name,
# and the reader's unpickler imports it from there. Set on purpose, not left to wherever the function lives:
# moving or renaming it (or this module) would change every tensor message's bytes and make those written before
# unreadable. tests/test_serialization.py loads a tensor message made with this name and checks that the name
# still imports; change it only on purpose, with that test and tests/fuzz/make_corpus.py's corpus. It is the real
# module's path, not ``hotloop.serialization`` (its name before the queue became a package): a wire name must
# import in the reader, and no alias module is kept for it (messages between hotloop versions are not a goal).
WIRE_NAME = ("hotloop.queue.serialization", "_rebuild_tensor")
_rebuild_tensor.__module__, _rebuild_tensor.__qualname__ = WIRE_NAME


def _reduce_tensor(obj, keep_alive: list):
    """CPU tensors go out-of-band as raw bytes (torch's own pickling copies them in-band)."""
    import torch

    if obj.device.type != "cpu" or obj.is_sparse or obj.is_quantized or obj.is_nested:
        return obj.__reduce_ex__(5)
    t = obj.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.contiguous()
    dtype_name = str(t.dtype).removeprefix("torch.")
    if t.numel() == 0:
        return _rebuild_tensor, (None, dtype_name, tuple(t.shape), obj.requires_grad)
    keep_alive.append(t)  # the buffer below points into t's memory until the message is written
    raw = t.reshape(-1).view(torch.uint8)
    view = (ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())
    return _rebuild_tensor, (pickle.PickleBuffer(memoryview(view).cast("B")), dtype_name, tuple(t.shape),
                             obj.requires_grad)


def _out_of_band_into(buffers: list):
    """The pickler's buffer_callback: a contiguous buffer goes out-of-band into `buffers`."""
    append = buffers.append

    def out_of_band(pb: pickle.PickleBuffer):
        try:
            append(pb.raw())
        except BufferError:  # not contiguous: pickled in-band instead
            return True
        return False

    return out_of_band


class _Encoder:
    """A pickler kept per thread (building one per message costs more than pickling a small one).

    It writes into a list: the C pickler hands over its finished output buffer as one bytes object (several
    chunks only for a pickle over 64 KiB), so nothing is copied or allocated after pickling."""

    __slots__ = ("chunks", "buffers", "keep_alive", "pickler", "dump", "clear_memo", "torch_registered", "native")

    def __init__(self):
        self.chunks = []
        self.buffers = []
        self.keep_alive = []
        # Nothing the pickler holds refers back to the encoder (its callbacks hold the lists only): the native
        # sink below is not seen by the garbage collector, so a cycle through it would outlive the thread.
        self.pickler = pickle.Pickler(_ListWriter(self.chunks.append), protocol=5,
                                      buffer_callback=_out_of_band_into(self.buffers))
        self.dump, self.clear_memo = self.pickler.dump, self.pickler.clear_memo  # bound once: a lookup less each
        self.torch_registered = False
        # The same pickler for ShmRing.write_object, which pickles and writes a bare pickle in one call.
        self.native = _core.PickleSink(self.dump, self.clear_memo, self.chunks, self.buffers, self.keep_alive)

    def register_torch(self):
        torch = sys.modules["torch"]
        table = dict(copyreg.dispatch_table)
        keep_alive = self.keep_alive
        table[torch.Tensor] = lambda t: _reduce_tensor(t, keep_alive)
        self.pickler.dispatch_table = table  # consulted by exact type, in C: other objects pay nothing
        self.torch_registered = self.native.torch_registered = True


class _ListWriter:
    """The pickler's file: each write appends its bytes to a list."""

    def __init__(self, append):
        self.write = append


class _PerThread(threading.local):
    def __init__(self):
        self.encoder = _Encoder()


_PER_THREAD = _PerThread()
_NOTHING_TO_KEEP = ()
_MODULES = sys.modules


def encoder() -> _Encoder:
    """The calling thread's pickler (ShmRing.write_object finds the same one through THREAD_PICKLERS; when it
    returns False, ``assemble`` this)."""
    enc = _PER_THREAD.encoder
    if not enc.torch_registered and _MODULES.get("torch") is not None:  # None: torch's import is blocked
        enc.register_torch()
    return enc


# Every thread's encoder as ShmRing.write_object finds the calling thread's: in its thread-state dict, in C++.
THREAD_PICKLERS = _core.ThreadPicklers(lambda: encoder().native)


def dumps(obj) -> tuple[tuple, tuple | list]:
    """The parts of one message, and the objects that must stay alive until they are written."""
    enc = encoder()
    try:
        enc.dump(obj)
    except BaseException:
        enc.chunks.clear()
        enc.buffers.clear()
        enc.keep_alive.clear()
        raise
    finally:
        enc.clear_memo()  # the memo would keep this message's objects alive
    return assemble(enc)


def assemble(enc: _Encoder) -> tuple[tuple, tuple | list]:
    """The parts of the message `enc` pickled, and the objects that must stay alive until they are written;
    leaves `enc` empty."""
    chunks = enc.chunks
    last = chunks.pop()
    if not chunks and not enc.buffers:  # the fast path: the pickle stream is the message
        return (last,), _NOTHING_TO_KEEP
    chunks.append(last)
    pickled, buffers, keep_alive = tuple(chunks), enc.buffers, enc.keep_alive
    chunks.clear()
    if not buffers:
        return pickled, _NOTHING_TO_KEEP
    # Copied, then emptied in place: the encoder's lists are shared with its PickleSink.
    buffers, keep_alive = buffers[:], keep_alive[:]
    enc.buffers.clear()
    enc.keep_alive.clear()
    header = _HEAD.pack(MAGIC, len(buffers), sum(memoryview(c).nbytes for c in pickled))
    header += struct.pack(f"<{len(buffers)}Q", *(b.nbytes for b in buffers))
    return (header, *pickled, *buffers), keep_alive


NOTHING = object()  # what ShmRing.read_object returns on timeout (None is a message like any other)


def loads(buffer):
    """Rebuild an object from one message (any buffer-protocol object, e.g. what ShmRing.read returns).

    Raises ValueError ("corrupt message: ...", the unpickler's error as ``__cause__``) for a malformed message."""
    try:  # bytes, a bytearray or a byte memoryview (what the ring returns) holding a bare pickle: the fast path
        bare = buffer[0] == _PROTO
    except Exception:  # empty, or not indexed by byte: the general path below sorts it out
        bare = False
    if bare:
        try:
            return _pickle_loads(buffer)
        except Exception as e:
            _raise_corrupt(e)
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view and view[0] == _PROTO:  # a bare pickle in another kind of buffer
        return _unpickle(view, None)
    if view.nbytes < _HEAD.size:
        raise ValueError(f"corrupt message: {view.nbytes} bytes is shorter than a message header")
    magic, n_buffers, n_pickle = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ValueError(f"corrupt message: bad magic {bytes(magic)!r} (expected a pickle, or {MAGIC!r}); "
                         "was it written by enqueue_bytes? read it with dequeue_bytes")
    off = _HEAD.size
    if off + 8 * n_buffers + n_pickle > view.nbytes:  # checked before the lengths are read: no huge unpack
        raise ValueError(f"corrupt message: its header announces {n_buffers} buffers and a pickle of {n_pickle} "
                         f"bytes, more than its {view.nbytes} bytes")
    if n_buffers == 0:
        if off + n_pickle != view.nbytes:
            raise ValueError("corrupt message: its lengths do not add up to its size")
        return _unpickle(view[off:], None)
    lengths = struct.unpack_from(f"<{n_buffers}Q", view, off)
    off += 8 * n_buffers
    if off + n_pickle + sum(lengths) != view.nbytes:
        raise ValueError("corrupt message: its lengths do not add up to its size")
    data = view[off:off + n_pickle]
    off += n_pickle
    oob = []
    for n in lengths:
        oob.append(view[off:off + n])
        off += n
    return _unpickle(data, oob)


def _unpickle(data, buffers):
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as e:
        _raise_corrupt(e)


def _raise_corrupt(e: Exception):
    """Raise the ValueError of a pickle that cannot be rebuilt, `e` (the unpickler's error) chained."""
    if isinstance(e, ValueError):
        if str(e).startswith("corrupt message:"):
            raise e
        raise ValueError(f"corrupt message: cannot unpickle it ({type(e).__name__}: {e})") from e
    # UnpicklingError, EOFError, ImportError, AttributeError, TypeError, IndexError, ...
    raise ValueError(f"corrupt message: cannot unpickle it ({type(e).__name__}: {e}); it is damaged, or holds an "
                     "object this process cannot rebuild") from e


# ShmRing.read_object's loaders: a bare pickle in ring memory goes to pickle.loads as a read-only view; anything
# else (a message with buffers, a corrupt one) to loads() as an owned copy.
OBJECT_LOADERS = _core.ObjectLoaders(_pickle_loads, loads, NOTHING)
