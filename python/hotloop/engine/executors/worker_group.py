"""WorkerGroupExecutor: the engine's side of an executor whose ranks run in worker processes (one per
tensor-parallel rank), whoever places them (MultiprocExecutor: multiprocessing on this node; a Ray executor:
actors on any node).

Contract: each step's scheduler output is broadcast to every rank through one ``MessageQueue`` (``_bcast``:
readers below ``n_local_reader`` on this node read shared memory, the others read over the authenticated TCP
path); rank 0 answers the sampled tokens on a response queue it writes and the engine reads (``_response``).
The wait sources are that reader and the ``failed`` flag: a subclass that learns that a rank died (a process
sentinel, an actor's death, a liveness link) calls ``_fail(why)``, and the next ``poll`` / ``wait`` raises
ExecutorError with ``why``, within milliseconds. When rank 0's answers end before that report (the answers'
connection and rank 0's watcher see the same death or partition, in either order), ``poll`` waits up to
REPORT_GRACE_S for it, and without one names rank 0 as ``_describe(0)`` does (a subclass says where it runs).
``shutdown()`` shuts the broadcast queue down (the workers' loops return), calls the subclass's
``_stop_workers()``, and closes both queues; it is idempotent.

A subclass starts its workers with the broadcast handle (``_bcast.export_handle()``), gets rank 0's response
handle back, and calls ``_connect(response_handle, timeout)``; on a failed start it calls ``shutdown()``.
"""

from __future__ import annotations

import abc

from hotloop import MessageQueue
from hotloop._core import ClosedError, DeadPeerError, Flag, wait_any
from hotloop.engine.executors.base import Executor
from hotloop.engine.scheduler import SchedulerOutput
from hotloop.errors import ExecutorError

STEP_CHUNK_BYTES = 1 << 20  # one record holds a step's scheduler output (larger ones are split)
SUBMIT_TIMEOUT_S = 60  # a full broadcast ring for this long means a worker stopped reading
# After rank 0's answers ended: how long to wait for the report that says which rank and why. A process's death
# is reported within milliseconds (a sentinel; Ray: 20 ms after a SIGKILL); a node cut off, within about a second
# of the answers' own connection: both it and rank 0's liveness link give the node up once nothing came from it
# for the peer timeout (each hears a heartbeat every 0.5 s; the queue's timer starts at its next PING, up to 0.5 s
# later), in either order; 0.5 s more for a busy machine's scheduling.
REPORT_GRACE_S = 1.5


class WorkerGroupExecutor(Executor):
    def __init__(self, tp: int, device: str, n_local_reader: int | None = None, connect_ip: str | None = None):
        """Broadcast readers below `n_local_reader` (default: all) read shared memory; the others connect to
        `connect_ip` (this node's address as theirs reach it; see MessageQueue)."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {tp!r}")
        self.tp = tp
        self.device = device
        self.failed = Flag()
        self.error: str | None = None
        self.sources: list = []
        self._stopping = False  # shutdown() began: a rank that exits now is not a failure
        self._response: MessageQueue | None = None
        self._bcast = MessageQueue(tp, n_local_reader, max_chunk_bytes=STEP_CHUNK_BYTES, connect_ip=connect_ip)

    def _connect(self, response_handle, timeout: float) -> None:
        """Read rank 0's answers from `response_handle` and wait until every rank reads the broadcast queue."""
        self._response = MessageQueue.create_from_handle(response_handle, 0)
        self._bcast.wait_until_ready(timeout)
        self.sources = [self._response, self.failed]

    def _fail(self, why: str) -> None:
        """A rank died (or cannot serve): fail the step in flight and every later one with `why`."""
        if self._stopping:
            return
        self.error = why
        self.failed.set()

    def _check(self) -> None:
        if self.failed.is_set():
            raise ExecutorError(self.error)

    def submit(self, out: SchedulerOutput) -> None:
        self._check()
        try:
            self._bcast.enqueue(out, timeout=SUBMIT_TIMEOUT_S)
        except (DeadPeerError, TimeoutError) as e:
            raise ExecutorError(f"cannot send the step to the workers: {e}") from e
        self.in_flight = True

    def poll(self):
        if self._response.readable():
            self.in_flight = False
            try:
                return self._response.dequeue(timeout=0) or []
            except (DeadPeerError, ClosedError) as e:  # rank 0's answers ended: it died, raised or was cut off
                wait_any([self.failed], timeout=REPORT_GRACE_S)  # the report naming the rank and why, if one comes
                self._check()
                raise ExecutorError(f"{self._describe(0)}: its answers stopped: {e}") from e
        self._check()
        return None

    def _describe(self, rank: int) -> str:
        """`rank` as errors name it (a subclass adds where it runs)."""
        return f"rank {rank}"

    @abc.abstractmethod
    def _stop_workers(self) -> None:
        """Make every worker exit (they were asked to by the broadcast queue's shutdown) and release them."""

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._bcast.shutdown()
        self._stop_workers()
        self._bcast.close()
        if self._response is not None:
            self._response.close()
