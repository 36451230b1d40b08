"""Fuzz hotloop.MessageQueue.create_from_handle: a reader attaching from a handle another process sent.

Each input starts from a real handle: a fresh MessageQueue(n_reader=1) (shared memory), or a
MessageQueue(n_reader=2, n_local_reader=1) whose rank 1 reads over TCP on 127.0.0.1. It then replaces fields
(found with dataclasses.fields(Handle), so fields added later are fuzzed too) with values of the right type at
their edges or of other types, or passes an object that is no Handle, with a valid or invalid rank.

Contract checked: create_from_handle returns a reader (closed at once) or raises BadHandleError, ValueError or
TypeError with a message; never another exception, a crash, or a hang (libFuzzer -timeout: a remote reader
connecting to a dead address must not block); and once the reader (if any) and the writer are closed, no thread,
OS thread, file descriptor, /dev/shm segment of this process, or ResourceWarning (an object left to the
garbage collector unclosed) is left behind. Every address the fuzzer makes is on 127.0.0.1 (any other one is
rewritten to it before use): it never connects off this machine.

Long run:  python tests/fuzz/fuzz_handle.py -max_total_time=600 tests/fuzz/corpus/handle
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import threading
import warnings

import atheris
import zmq

import _common

import hotloop
from hotloop.queue import message_queue
from hotloop.queue.remote import RemoteSubscriber

# Coverage for libFuzzer: the handle checks and reader set-up in Python (the C++ attach is not instrumented).
for _fn in (message_queue.MessageQueue.create_from_handle, message_queue.MessageQueue.close):
    atheris.instrument_func(_fn)

Handle = message_queue.Handle
ACCEPTED = (hotloop.BadHandleError, ValueError, TypeError)
INTS = [0, 1, 2, -1, 3, 255, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -2**63, 10**30]
_LOOPBACK = re.compile(r"tcp://127\.\d{1,3}\.\d{1,3}\.\d{1,3}:[0-9]*$")


class _NotAHandle:
    def __init__(self, handle):
        self.__dict__.update(dataclasses.asdict(handle))


def _other_values(fdp: atheris.FuzzedDataProvider, original):
    """A value for a field whose real value is `original`: a near or edge value of its type, or another type."""
    kind = fdp.ConsumeIntInRange(0, 9)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.PickValueInList([1.5, float("nan"), b"x", [], (), {}, True, False, object()])
    if kind == 2:
        return INTS[fdp.ConsumeIntInRange(0, len(INTS) - 1)]
    if kind == 3:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if isinstance(original, bool):
        return not original
    if isinstance(original, int):
        return original + fdp.ConsumeIntInRange(-3, 3) if kind < 7 else fdp.ConsumeIntInRange(-2**64, 2**64)
    if isinstance(original, str):
        if kind == 4:
            return original[:fdp.ConsumeIntInRange(0, len(original))]
        if kind == 5:
            return original + fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8))
        if kind == 6 and original:
            i = fdp.ConsumeIntInRange(0, len(original) - 1)
            return original[:i] + fdp.ConsumeUnicodeNoSurrogates(1) + original[i + 1:]
        return original.replace(str(os.getpid()), str(fdp.ConsumeIntInRange(0, 2**22)))
    return fdp.ConsumeIntInRange(-2**64, 2**64)


def _loopback_only(value):
    """Keep every endpoint on this machine: a string naming another host is pointed at 127.0.0.1."""
    if isinstance(value, str) and "://" in value and not _LOOPBACK.match(value):
        return "tcp://127.0.0.1:" + "".join(c for c in value.rsplit(":", 1)[-1] if c.isdigit())[:5]
    return value


class Writers:
    """A fresh shared-memory writer per input (an attach consumes it); one TCP writer, renewed now and then."""

    def __init__(self):
        self.remote = None
        self.remote_uses = 0

    def local(self):
        return hotloop.MessageQueue(n_reader=1, max_chunk_bytes=1000)

    def remote_queue(self):
        if self.remote is None or self.remote_uses >= 500:
            self.close()
            self.remote = hotloop.MessageQueue(n_reader=2, n_local_reader=1, max_chunk_bytes=1000,
                                               connect_ip="127.0.0.1", bind_ip="127.0.0.1")
            self.remote_uses = 0
        self.remote_uses += 1
        return self.remote

    def close(self):
        if self.remote is not None:
            self.remote.close()
            self.remote = None


WRITERS = Writers()
_f5_seen = False  # an F5 case ran in this process (see the leak check)


def _state():
    mine = re.compile(rf"hotloop-(?:\d+-)?{os.getpid()}-")  # hotloop-[<pid namespace>-]<pid>-...
    keep = WRITERS.remote.name.lstrip("/") if WRITERS.remote is not None else None  # the TCP writer's own ring
    shm = sorted(n for n in os.listdir("/dev/shm") if mine.match(n) and n != keep)
    return (threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), shm)


def _mark_f5():
    global _f5_seen
    _f5_seen = True


def attach(handle, rank):
    """create_from_handle; returns (exception or None). A reader it returns is closed."""
    reader = None
    try:
        reader = hotloop.MessageQueue.create_from_handle(handle, rank)
    except ACCEPTED as e:
        if not str(e).strip():
            raise _common.Finding(f"{type(e).__name__} without a message for handle {handle!r}, rank {rank!r}")
        return e
    except zmq.ZMQError as e:
        _mark_f5()
        _common.known(f"F5 create_from_handle raised zmq.ZMQError for handle {handle!r}, rank {rank!r}: {e}")
        return e
    except OverflowError as e:
        _mark_f5()
        _common.known(f"F5 create_from_handle raised OverflowError for handle {handle!r}, rank {rank!r}: {e}")
        return e
    except Exception as e:
        raise _common.Finding(f"create_from_handle raised {type(e).__name__}, not BadHandleError / ValueError / "
                              f"TypeError: {e!r}; handle {handle!r}, rank {rank!r}") from e
    finally:
        if reader is not None:
            reader.close()
    return None


def _raised_in_remote_subscriber(e) -> bool:
    """Whether `e` came out of a RemoteSubscriber.__init__ (where F5 left a ZeroMQ context behind): one of its
    traceback's frames runs that very function's code. Matched by the code object, read from the class at each
    call, not by a file or function name, so a move or rename fails at the import above instead of making this
    check silently False (tests/test_fuzz.py checks both answers)."""
    init_code = RemoteSubscriber.__init__.__code__
    tb = getattr(e, "__traceback__", None)
    while tb is not None:
        if tb.tb_frame.f_code is init_code:
            return True
        tb = tb.tb_next
    return False


def case_from_input(data: bytes):
    """(use the TCP writer?, replacements {field: value} or a non-Handle object maker, rank)."""
    fdp = atheris.FuzzedDataProvider(data)
    remote = fdp.ConsumeBool()
    fields = [f.name for f in dataclasses.fields(Handle)]
    how = fdp.ConsumeIntInRange(0, 7)
    return remote, how, fdp, fields


def _left_behind(now, before) -> bool:
    return any(n > b for n, b in zip(now[:3], before[:3])) or not set(now[3]) <= set(before[3])


def TestOneInput(data: bytes) -> None:
    remote, how, fdp, fields = case_from_input(data)
    # Counted against this input's own start (objects an earlier F5 case left may be collected at any time: that
    # only lowers the counts).
    before = _state()
    writer = WRITERS.remote_queue() if remote else WRITERS.local()
    if remote and WRITERS.remote_uses == 1:  # a new TCP writer: count from here
        before = _state()
    handle = writer.export_handle()
    n_reader = handle.n_reader
    outcome = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        try:
            if how == 0:  # no Handle at all
                handle = fdp.PickValueInList([None, 0, "handle", b"", (), dataclasses.asdict(handle),
                                              dataclasses.astuple(handle), _NotAHandle(handle), Handle])
            else:
                changes = {}
                for _ in range(fdp.ConsumeIntInRange(0 if how == 1 else 1, 3)):
                    name = fields[fdp.ConsumeIntInRange(0, len(fields) - 1)]
                    changes[name] = _loopback_only(_other_values(fdp, getattr(handle, name)))
                handle = dataclasses.replace(handle, **changes)
            rank = (fdp.ConsumeIntInRange(0, n_reader - 1) if fdp.ConsumeBool()
                    else fdp.PickValueInList([-1, n_reader, 2**32, 2**64, -2**63, 1.0, "0", None, True, False]))
            if remote and rank == 0 and how != 0:
                rank = n_reader - 1  # rank 0 of the TCP writer's queue is attached by nobody: keep it that way
            outcome = attach(handle, rank)
        finally:
            if not remote:
                writer.close()
        what = f"handle {handle!r}, rank {rank!r}, outcome {outcome!r}"
        in_subscriber = _raised_in_remote_subscriber(outcome)
        outcome_none = outcome is None
        outcome = None  # drop the exception (and the frames it holds) before counting what is left
        # Threads and descriptors may take a moment to go (the writer's side of a closed TCP connection, say):
        # up to 3 s on a loaded machine (0.1 s after F5, which leaves them for good).
        for attempt in range(20 if in_subscriber else 600):
            now = _state()
            if not _left_behind(now, before):
                break
            if attempt % 20 == 0:
                gc.collect()
            threading.Event().wait(0.005)
        else:
            global _f5_seen
            segments_left = not set(now[3]) <= set(before[3])
            if not segments_left and remote and not in_subscriber and outcome_none:
                # F6 (README): after a reader of the long-lived TCP writer attached and closed, the process sometimes
                # keeps one more OS thread and five more descriptors for good; counts are not trusted after it
                _f5_seen = True
                _common.known(f"F6 a remote reader that attached and closed left (threads, OS threads, fds): "
                              f"{now[:3]}, before {before[:3]}; {what}")
                return
            if segments_left or not (in_subscriber or _f5_seen):
                raise _common.Finding(f"left behind (threads, OS threads, fds, segments): {now}, before {before}; "
                                      f"{what}")
            # What F5 leaves changes later on its own (libzmq threads and descriptors go when the collector gets
            # to the sockets): once it happened, thread and descriptor counts are no longer trusted.
            _f5_seen = True
            _common.known(f"F5 a RemoteSubscriber that failed in __init__ left its ZeroMQ context behind: {now}, "
                          f"before {before}; {what}")
    warned = [w for w in caught if issubclass(w.category, ResourceWarning)]
    if warned:
        _common.known(f"F5 a failed create_from_handle left objects to the garbage collector unclosed: "
                      f"{warned[0].message}; {what}")


def main():
    try:
        _common.run_atheris(TestOneInput)
    finally:
        WRITERS.close()


if __name__ == "__main__":
    main()
