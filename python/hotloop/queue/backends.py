"""The backends a MessageQueue is a facade over, declared: what the queue needs from each, so a reader behaves
the same whichever backend it has, in ``dequeue``, ``wait_any`` / ``Waiter`` (its ``source``) and asyncio.

- ``ReaderBackend``: one reader's end. ``hotloop._core.ShmRing`` attached as a reader (shared memory, ranks below
  ``n_local_reader``) and ``remote.RemoteSubscriber`` (the network, the other ranks) implement it.
- ``WriterBackend``: the writer's end towards one set of readers. ``ShmRing`` created by the writer (its local
  readers) and ``remote.RemotePublisher`` (its remote readers) implement it; a writer with both writes to
  the network first, then to shared memory.

Errors are the same from every backend: QueueTimeout, a TimeoutError (a write that found no room within the
timeout; ``read*`` and ``wait_*`` return None / False instead, and the queue raises it), ClosedError (shut down,
or this reader's waits cancelled), DeadPeerError (the other side died).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hotloop._core import Source, WaitPolicy


@runtime_checkable
class ReaderBackend(Protocol):
    name: str

    @property
    def source(self) -> Source:
        """The wait_any source: ready while a message is waiting (or the queue is closed / its writer dead)."""

    def readable(self) -> bool:
        """Whether a message is waiting; never blocks."""

    def wait_readable(self, timeout: float | None, policy: WaitPolicy) -> bool:
        """Wait until a message is waiting: True, or False at the timeout."""

    def read(self, timeout: float | None, policy: WaitPolicy):
        """The next message as a writable buffer the caller owns, or None at the timeout."""

    def read_view(self, timeout: float | None, policy: WaitPolicy):
        """The next message lent as a read-only view, valid until ``release()``; None at the timeout."""

    def release(self) -> None:
        """Hand back the message ``read_view`` lent."""

    def cancel_waits(self) -> None:
        """End this reader's waits, running and later, with ClosedError (from any thread)."""

    def close(self) -> None:
        """Detach; idempotent."""


@runtime_checkable
class WriterBackend(Protocol):
    name: str

    @property
    def n_readers(self) -> int:
        """The readers this backend writes to."""

    @property
    def attached_readers(self) -> int:
        """How many of them are attached now."""

    def write(self, parts: list, timeout: float | None, policy: WaitPolicy) -> None:
        """Send one message made of `parts` (bytes-like) to every reader of this backend."""

    def wait_all_attached(self, timeout: float | None, policy: WaitPolicy) -> bool:
        """Wait until every reader attached: True, or False at the timeout."""

    def shutdown(self) -> None:
        """No more messages: readers get ClosedError once they have read the rest."""

    def close(self) -> None:
        """Shut down (in the process that made it; a copy inherited by a fork leaves it alone) and release;
        idempotent."""
