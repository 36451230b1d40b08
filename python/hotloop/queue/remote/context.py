"""The ZeroMQ context that every remote queue end of a process shares, with its fork and exit handling.

``ProcessZmq.acquire()`` / ``release()`` count the ends that use it; the last release terminates it (``term()``
waits for sockets' linger, outside the lock). A forked child never uses or terminates its parent's context: it
makes its own on first use, with a fresh lock (``os.register_at_fork``). Ends still open when the interpreter
exits are closed by an ``atexit`` hook while the process's threads still run (``OPEN_ENDS``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import weakref

import zmq

from hotloop.queue.remote.curve import ZAP_DOMAIN, ZapHandler


class ProcessZmq:
    """The ZeroMQ context every remote queue end of this process shares, and its one ZAP handler.

    One context, so one ZeroMQ I/O thread carries a process's writers and readers (a 64 B round trip through a
    writer and a reader in each of two processes measured 1.12x slower with a context per queue end: two I/O
    threads per process to wake instead of one). Counted: the last end to close terminates it. A writer's close()
    does not rely on that to send what it queued: it waits for its own socket's end (RemotePublisher
    ._wait_until_sent). A forked child makes its own on first use and leaves the parent's alone."""

    _lock = threading.Lock()
    _current: ProcessZmq | None = None
    _inherited: list[ProcessZmq] = []  # a parent's, seen after a fork: kept, never used or terminated

    def __init__(self):
        self.pid = os.getpid()
        self.ctx = zmq.Context()
        self.users = 0
        self.zap: ZapHandler | None = None
        self._domains = 0

    @classmethod
    def acquire(cls) -> ProcessZmq:
        with cls._lock:
            cls._set_aside_parents()  # a fork that skipped the at-fork hook (not through os.fork)
            if cls._current is None:
                cls._current = cls()
            cls._current.users += 1
            return cls._current

    def release(self) -> None:
        with self._lock:
            if self.pid != os.getpid():
                return
            self.users -= 1
            if self.users:
                return
            if ProcessZmq._current is self:
                ProcessZmq._current = None  # a queue opened from now on gets a new context
        if sys.is_finalizing():
            # The interpreter is past its exit handlers: its daemon threads (the ZAP handler's) were stopped
            # where they stood and never close their sockets, so term() would wait forever. The process is
            # ending; its kernel closes every connection. (Ends open at exit are closed before: _close_at_exit.)
            return
        # Outside the lock: term() waits for the sockets' linger, and other threads may open queues meanwhile.
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()

    @classmethod
    def _after_fork_in_child(cls) -> None:
        # Another thread may have held the lock when this process was forked: the child gets a fresh one, and
        # leaves the parent's context (and its threads, which the child does not have) alone.
        cls._lock = threading.Lock()
        cls._set_aside_parents()

    @classmethod
    def _set_aside_parents(cls) -> None:
        """In a forked child: keep the parent's context (never used or terminated here) and start afresh."""
        if cls._current is not None and cls._current.pid != os.getpid():
            cls._inherited.append(cls._current)
            cls._current = None

    def admit(self, client_keys: dict[bytes, int]) -> str:
        """A new ZAP domain under which exactly `client_keys` (z85 public key -> rank) are admitted."""
        with self._lock:
            if self.zap is None:
                self.zap = ZapHandler(self.ctx)
                self.zap.start()
            self._domains += 1
            domain = f"{ZAP_DOMAIN}-{self._domains}"
            self.zap.admit(domain, client_keys)
            return domain

    def forget(self, domain: str) -> None:
        with self._lock:
            if self.zap is not None and self.pid == os.getpid():
                self.zap.forget(domain)


os.register_at_fork(after_in_child=ProcessZmq._after_fork_in_child)

OPEN_ENDS: weakref.WeakSet = weakref.WeakSet()  # this process's remote queue ends not closed yet


@atexit.register
def _close_at_exit() -> None:
    """Close the remote queue ends still open when the interpreter exits (a queue in a module global, say), while
    the process's threads still run: a writer's last messages go out and its shutdown reaches its readers. Left
    to the garbage collector at interpreter teardown, the ZeroMQ context could not be terminated (see
    ProcessZmq.release) and the process hung there."""
    for end in list(OPEN_ENDS):
        with contextlib.suppress(Exception):
            end.close()
