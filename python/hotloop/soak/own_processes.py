"""The soak's process helpers: which processes are its own, signalling them safely, what they leave behind.

Contract:

- ``CTX`` (spawn) starts every child process: the soak runs threads and ZeroMQ contexts and never forks.
- ``send_signal`` signals a pid only while it is one of the soak's own processes (pinned by a pidfd, its parent
  chain checked), so a reused pid is never signalled; ``start_time`` tells a live pid from a reused one.
- ``children_of`` / ``descendants_of`` read /proc (multiprocessing's resource tracker left out);
  ``shm_entries`` / ``open_fds`` list what the leak check compares; ``creator_pid`` reads the creator's pid
  from a segment's name. All of these are cheap reads of /proc and /dev/shm, called by monitors, not data paths.
- ``percentiles``: p50 / p99 / max by rank (nearest rank, no interpolation).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import sys
import time

CTX = mp.get_context("spawn")  # this process runs threads and ZeroMQ contexts: never fork it
LOOPBACK = "127.0.0.1"
HANG_S = 30.0  # an outcome not reached within this long after the previous sign of life is a hang
START_TIMEOUT_S = 120.0


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the soak) dies, so an interrupted soak leaves nothing running."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/pid/stat): tells a live pid from a reused one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _ours(pid: int) -> bool:
    """Whether `pid` is this process or one of its descendants (walks the parent chain in /proc)."""
    me, seen = os.getpid(), set()
    while pid > 1 and pid not in seen:
        if pid == me:
            return True
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def send_signal(pid: int, sig: int) -> bool:
    """Signal `pid` only if it is still one of the soak's own processes: a pidfd pins the process first, then its
    parent chain is checked, so a pid reused by another program (after ours died) is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not _ours(pid):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def children_of(pid: int) -> set[int]:
    """Direct children of `pid`, without multiprocessing's resource tracker."""
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    if b"resource_tracker" in f.read():
                        continue
            except OSError:
                continue
            out.add(k)
    return out


def descendants_of(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for k in children_of(todo.pop()):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def creator_pid(segment: str) -> int | None:
    """hotloop-<namespace>-<creator pid>-...: the process that created a /dev/shm segment."""
    try:
        return int(segment.split("-")[2])
    except (IndexError, ValueError):
        return None


def shm_entries() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("hotloop-")}


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    s = sorted(xs)

    def rank(p):
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"n": len(s), "p50": rank(0.50), "p99": rank(0.99), "max": s[-1]}
