"""hotloop.vllm.MessageQueue: hotloop's queue with vLLM's MessageQueue surface, so vLLM's executor and workers
use it unchanged.

Contract:

- Same calls as vLLM's ``vllm.distributed.device_communicators.shm_broadcast.MessageQueue`` (0.32):
  ``MessageQueue(n_reader, n_local_reader, local_reader_ranks=None, max_chunk_bytes=..., max_chunks=...,
  connect_ip=None, enable_shm_tensor_arena=False)`` (the writer), ``export_handle()``,
  ``MessageQueue.create_from_handle(handle, rank)`` (a reader), ``wait_until_ready()``,
  ``enqueue(obj, timeout=None)``, ``dequeue(timeout=None, indefinite=False)``, ``acquire_read(timeout=None,
  indefinite=False)``, ``broadcast_object(obj=None)``, ``shutdown()``, ``create_from_process_group(...)`` and
  ``create_from_process_group_single_reader(...)`` (these two need vLLM; the rest does not).
- Ranks are vLLM's: a rank in ``local_reader_ranks`` reads shared memory (local reader i of hotloop's ring is
  ``local_reader_ranks[i]``); any other rank reads over TCP (CurveZMQ, ``queue/remote/``), its slot taken from
  ``remote_reader_ranks`` (default: the lowest ranks that are not local, which is how vLLM's executors number
  their workers). A rank that is in neither list takes the only remote slot when there is exactly one (vLLM
  passes rank -1 for a single-reader queue on another node) and is refused with BadHandleError otherwise.
- Errors are those vLLM catches: a dequeue or enqueue that times out raises QueueTimeout (a TimeoutError);
  ``shutdown()`` on a reader (from any thread: vLLM's death-pipe monitor) ends this reader's waits, running or later,
  with ClosedError, a RuntimeError as vLLM's "cancelled" is; ``fail(reason)`` does the same with
  DeadPeerError(reason) (a peer known lost: ``ray_liveness.py``); a dead writer raises DeadPeerError (a RuntimeError)
  in its readers once they read what it sent, and a dead reader raises DeadPeerError in the writer's next enqueue
  (where vLLM's own queue would wait until its timeout). A reader whose ``report_grace_s`` is set (0 by default;
  ``ray_liveness.py`` sets it on the executor's readers of the ranks' answers) waits that long, once its writer's
  connection is lost, for a ``fail(reason)`` that names the peer, and raises with that reason when it comes.
- ``dequeue(timeout=None)`` without ``indefinite`` logs vLLM's "No available shared memory broadcast block"
  line every ``VLLM_RINGBUFFER_WARNING_INTERVAL`` seconds of waiting, as vLLM's queue does; the wait itself is
  hotloop's (spin, yield, park, GIL released): an idle reader costs no CPU. A shared-memory reader's wait is chosen
  at its first read (``step_wait.choose``): on vLLM's CPU platform a 1 ms yield budget before it parks; elsewhere
  paced (it learns the step period, sleeps on a timer until shortly before the next message and spins through
  it) where each process has a core, plain where the engine core and workers outnumber the cores;
  ``HOTLOOP_VLLM_PACED`` and ``HOTLOOP_VLLM_YIELD_US`` override it.
- What differs: the ring holds 4 x min(max_chunk_bytes, RING_CHUNK_CAP) bytes (``max_chunks`` is ignored); a
  larger message is split across records instead of going over a socket. ``enable_shm_tensor_arena`` is
  ignored (tensors travel out-of-band through the ring: one copy in, one out). ``acquire_read`` lends the
  message in hotloop's format (a pickle-5 message, ``hotloop.queue.serialization``), not vLLM's slot layout.
- Handles: this class's ``Handle`` is not vLLM's. Reading one with vLLM's own class, or passing vLLM's handle to
  this one, raises an error saying to enable the plugin in every process of the deployment, or in none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import weakref

from hotloop.queue import message_queue as _hl
from hotloop._core import BadHandleError, ClosedError, DeadPeerError, WaitPolicy
from hotloop.vllm import step_wait

log = logging.getLogger("vllm.hotloop")

# A vLLM executor asks for 16 MiB chunks (24 MiB by default). hotloop's ring holds four records of the chunk
# size, and a ring walks its whole length over time (every page ends up resident), so the chunk is capped:
# 4 MiB chunks make a 16 MiB ring per queue. Steps (SchedulerOutput, ModelRunnerOutput) are a few KiB to a
# few hundred KiB; a larger message is split across records and still read as one object.
RING_CHUNK_CAP = 4 * 1024 * 1024 - 64

# What this process has seen of its deployment, for the readers' wait (step_wait.choose): the most local readers
# of a queue it writes or reads (the executor's step broadcast has one per worker on this host), and the most cores
# a process of it may run on (a queue's writer stamps its own on the handle: vLLM's CPU workers narrow their
# affinity to their OpenMP cores before they attach, the engine core does not).
_deployment = {"workers": 0, "cores": 0}


def _deployment_seen(local_readers: int, cores: int) -> None:
    _deployment["workers"] = max(_deployment["workers"], local_readers)
    _deployment["cores"] = max(_deployment["cores"], cores)

_VLLM_HANDLE_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_MIXED = ("enable hotloop's vLLM plugin in every process of the deployment or in none: set HOTLOOP_VLLM=1 in the "
          "environment vLLM starts from (workers inherit it) and, if VLLM_PLUGINS is set, list 'hotloop' in it")


@dataclasses.dataclass(frozen=True)
class Handle:
    """What a reader needs to attach (picklable; pass it only over a trusted channel, it holds the remote
    readers' keys). ``local_reader_ranks`` and ``remote_subscribe_addr`` are read by vLLM's executor as on its
    own Handle; the rest is hotloop's."""

    local_reader_ranks: list[int]
    remote_reader_ranks: list[int]
    queue: _hl.Handle = dataclasses.field(repr=False)
    remote_subscribe_addr: str | None = None  # the writer's tcp:// address when there are remote readers
    host_cores: float = 0  # the cores the writer's process may use, its cgroup's quota counted (step_wait.choose)

    # vLLM's own MessageQueue.create_from_handle reads these first: a clear error instead of an AttributeError.
    @property
    def buffer_handle(self):
        raise BadHandleError("vLLM's own MessageQueue was given a hotloop queue handle: " + _MIXED)

    @property
    def remote_addr_ipv6(self):
        raise BadHandleError("vLLM's own MessageQueue was given a hotloop queue handle: " + _MIXED)


def _check_ranks(ranks, what: str) -> list[int]:
    ranks = list(ranks)
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} must be distinct integers, got {ranks!r}")
    return ranks


def _warning_interval() -> float:
    with contextlib.suppress(Exception):
        import vllm.envs

        return float(vllm.envs.VLLM_RINGBUFFER_WARNING_INTERVAL)
    return float(os.environ.get("VLLM_RINGBUFFER_WARNING_INTERVAL", 60))


class MessageQueue(_hl.MessageQueue):
    """hotloop's MessageQueue (a wait_any source, ``readable()``, ``enqueue_bytes`` ...) with vLLM's calls.

    Its arguments and defaults are vLLM's, not ``hotloop.MessageQueue``'s, because vLLM's executors construct it
    (through the plugin) with vLLM's signature and nothing else:

    - ``n_local_reader`` is required, as in vLLM's class (hotloop's defaults to every reader being local).
    - ``max_chunk_bytes`` defaults to vLLM's 24 MiB (its executors pass 16 MiB), and whatever vLLM asks for is
      capped at ``RING_CHUNK_CAP`` (4 MiB less 64 bytes): a 16 MiB ring per queue, where hotloop's default 4 MiB
      chunk makes a 32 MiB one. vLLM opens several queues per deployment and each ring's pages end up resident.
    - ``dead_reader``, ``name``, ``bind_ip``, ``max_message_bytes`` and ``remote_hwm`` are not taken, and
      ``create_from_handle`` takes no ``node``: vLLM never passes them, so they keep hotloop's defaults (a dead
      reader raises DeadPeerError in the writer's next enqueue, as the module's contract says; the publisher
      binds on ``connect_ip``; the network readers of one node share its relay). Code that needs them uses
      ``hotloop.MessageQueue`` directly: this class is vLLM's surface over it and nothing more.
    """

    def __init__(self, n_reader, n_local_reader, local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int = 1024 * 1024 * 24, max_chunks: int = 10, connect_ip: str | None = None,
                 enable_shm_tensor_arena: bool = False, *, remote_reader_ranks: list[int] | None = None,
                 policy: WaitPolicy | None = None):
        """The writer, as vLLM's. remote_reader_ranks (hotloop's addition): the ranks that read over TCP, in
        slot order (default: the lowest non-negative ranks not in local_reader_ranks)."""
        if not isinstance(n_reader, int) or not isinstance(n_local_reader, int) or not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"need 0 <= n_local_reader <= n_reader, got n_reader={n_reader!r}, "
                             f"n_local_reader={n_local_reader!r}")
        local = _check_ranks(range(n_local_reader) if local_reader_ranks is None else local_reader_ranks,
                             "local_reader_ranks")
        if len(local) != n_local_reader:
            raise ValueError(f"local_reader_ranks {local} must list n_local_reader={n_local_reader} ranks")
        n_remote = n_reader - n_local_reader
        if remote_reader_ranks is None:
            remote, r = [], 0
            while len(remote) < n_remote:
                if r not in local:
                    remote.append(r)
                r += 1
        else:
            remote = _check_ranks(remote_reader_ranks, "remote_reader_ranks")
            if len(remote) != n_remote or set(remote) & set(local):
                raise ValueError(f"remote_reader_ranks {remote} must list the n_reader - n_local_reader = {n_remote} "
                                 f"ranks that are not local ({local})")
        super().__init__(n_reader, n_local_reader, max_chunk_bytes=min(int(max_chunk_bytes), RING_CHUNK_CAP),
                         policy=policy, connect_ip=connect_ip if n_remote else None)
        _deployment_seen(n_local_reader, step_wait.HOST_CORES)
        from hotloop.vllm import ray_liveness

        ray_liveness.install()  # vLLM's Ray executor builds its queues here, with its module loaded
        self.handle = Handle(local, remote, self._handle, self._handle.remote_address,  # vLLM's attribute name
                             host_cores=_deployment["cores"])
        if n_remote:
            log.info("hotloop: queue %s: %d reader(s) on other nodes connect to %s (CurveZMQ; the port must be open "
                     "to their nodes)", self.name, n_remote, self._handle.remote_address)
        self._set_vllm_attributes(n_local_reader, n_remote, -1)

    def _set_vllm_attributes(self, n_local_reader: int, n_remote_reader: int, local_reader_rank: int) -> None:
        # attributes vLLM's own class has and code around it may read
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_remote_reader
        self.local_reader_rank = local_reader_rank
        self._is_writer = self.rank < 0
        self._is_local_reader = local_reader_rank >= 0
        self._is_remote_reader = not self._is_writer and local_reader_rank < 0
        self.shutting_down = False
        self.tensor_arena = None
        self._failure: str | None = None
        self._failed = threading.Event()
        self.report_grace_s = 0.0

    def _use_policy(self, policy: WaitPolicy) -> None:
        self._policy = policy  # the policy the next ring read waits with (step_wait.py)

    def export_handle(self) -> Handle:
        return self.handle

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, policy: WaitPolicy | None = None) -> "MessageQueue":
        """Reader `rank` (a vLLM rank) of the queue `handle` describes."""
        if type(handle).__module__ == _VLLM_HANDLE_MODULE:
            raise BadHandleError("hotloop's MessageQueue was given a handle of vLLM's own MessageQueue "
                                 f"({type(handle).__name__}): " + _MIXED)
        if not isinstance(handle, Handle):
            raise BadHandleError(f"not a hotloop.vllm MessageQueue handle: {type(handle).__name__} "
                                 "(pass what export_handle() returned)")
        inner = handle.queue
        if rank in handle.local_reader_ranks:
            slot = handle.local_reader_ranks.index(rank)
        elif rank in handle.remote_reader_ranks:
            slot = inner.n_local_reader + handle.remote_reader_ranks.index(rank)
        elif len(handle.remote_reader_ranks) == 1:
            slot = inner.n_local_reader
        else:
            raise BadHandleError(f"queue {inner.name}: rank {rank!r} is not one of its readers (local ranks "
                                 f"{handle.local_reader_ranks}, remote ranks {handle.remote_reader_ranks}); "
                                 "attach with the rank the queue was created for")
        paced = step_wait.StepPacedWait()  # first: a bad HOTLOOP_VLLM_YIELD_US fails before attaching
        step_wait.paced_enabled()  # and a bad HOTLOOP_VLLM_PACED
        _deployment_seen(len(handle.local_reader_ranks), handle.host_cores)
        self = super().create_from_handle(inner, slot, policy)
        paced.park_policy = self._policy  # the reader's own (a network reader's parks at once)
        queue = weakref.ref(self)
        paced.parks = lambda: q.parks if (q := queue()) is not None else 0  # the chain counters' parks
        self.handle = handle
        self._paced = paced
        # a shared-memory reader without a policy of its own takes the host's rule (step_wait.choose) at its first
        # read, when this process has seen the executor's broadcast (the host's workers and cores)
        self._wait_undecided = policy is None and slot < inner.n_local_reader
        local = slot if slot < inner.n_local_reader else -1
        self._set_vllm_attributes(inner.n_local_reader, inner.n_reader - inner.n_local_reader, local)
        return self

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """vLLM's collective handshake: the writer waits until every reader attached; a reader returns at once
        (attaching already connected it)."""
        super().wait_until_ready(timeout)

    def shutdown(self) -> None:
        """Reader: end this reader's waits now and later with ClosedError (from any thread). Writer: no more
        messages; readers get ClosedError once they have read the rest."""
        self.shutting_down = True
        with contextlib.suppress(ClosedError):
            super().shutdown()

    def fail(self, reason: str) -> None:
        """Reader: end this reader's waits, running or later, with DeadPeerError(`reason`) (from any thread): what
        the engine is told when a peer it waits for is known lost (``ray_liveness.py``)."""
        self._failure = reason
        self._failed.set()
        self.shutdown()

    def dequeue(self, timeout: float | None = None, indefinite: bool = False):
        """The next object. TimeoutError after `timeout` s; ClosedError after shutdown(); DeadPeerError when
        the writer died or fail() was called. Without a timeout and without `indefinite`, logs vLLM's long-wait
        line periodically."""
        if self.is_writer:
            raise RuntimeError(f"queue {self.name}: only readers can dequeue; this is the writer")
        try:
            return self._dequeue(timeout, indefinite)
        except ClosedError:
            if self._failure is not None:
                raise DeadPeerError(self._failure) from None
            raise
        except DeadPeerError:  # the writer's connection was lost: a verdict naming the peer may be a moment behind
            if self.report_grace_s and self._failed.wait(self.report_grace_s):
                raise DeadPeerError(self._failure) from None
            raise

    def _choose_wait(self) -> None:
        self._wait_undecided = False
        wait = step_wait.choose(_deployment["workers"], cores=max(_deployment["cores"], step_wait.HOST_CORES),
                                quota=step_wait.HOST_QUOTA)
        if not step_wait.chosen:
            log.info("hotloop: shared-memory readers in process %d wait %s: %s", os.getpid(),
                     {"yield": f"with a {wait.cap_us:g} us yield budget, then park", "paced": "paced",
                      "plain": "plainly (spin, yield, park)"}[wait.kind], wait.why)
        step_wait.chosen.append((self.name, wait))
        self._paced.cap_s = wait.cap_us / 1e6
        self._use_policy(wait.policy() or self._policy)
        self._paced.park_policy = self._policy

    def _dequeue(self, timeout: float | None, indefinite: bool):
        if self._wait_undecided:
            self._choose_wait()
        if timeout is not None or indefinite:
            return self._paced.read(super().dequeue, self._use_policy, timeout)
        interval = _warning_interval()
        waited = 0.0
        while True:
            try:
                return self._paced.read(super().dequeue, self._use_policy, interval)
            except TimeoutError:
                waited += interval
                log.info("No available shared memory broadcast block found in %d seconds (hotloop queue %s, "
                         "reader rank %d). This typically happens when some processes are hanging or doing "
                         "some time-consuming work (e.g. compilation, weight/kv cache quantization).",
                         waited, self.name, self.rank)

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None, indefinite: bool = False):
        """Lend the next message (hotloop's format) as a read-only view; it is consumed when the block ends,
        also when the block raises."""
        if self.is_writer:
            raise RuntimeError(f"queue {self.name}: only readers can acquire_read; this is the writer")
        with super().acquire_read(timeout) as view:
            yield view

    def broadcast_object(self, obj=None):
        """Writer: send `obj` and return it; reader: return the next object."""
        if self.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    @staticmethod
    def create_from_process_group_single_reader(pg, max_chunk_bytes, max_chunks, reader_rank: int = 0,
                                                blocking: bool = False):
        """vLLM's: every rank of `pg` writes to `reader_rank` on its own queue; returns (queue, handles), the
        handles gathered on the reader rank only."""
        import torch.distributed as dist
        from vllm.platforms import current_platform
        from vllm.platforms.interface import get_assigned_physical_gpu_ids

        ids = get_assigned_physical_gpu_ids()
        local_size = len(ids) if ids is not None else current_platform.device_count()
        rank = dist.get_rank()
        same_node = rank // local_size == reader_rank // local_size
        queue = MessageQueue(n_reader=1, n_local_reader=1 if same_node else 0, max_chunk_bytes=max_chunk_bytes,
                             max_chunks=max_chunks)
        handle = queue.export_handle()
        handles = [None] * dist.get_world_size(pg) if rank == reader_rank else None
        dist.gather_object(handle, handles, dst=reader_rank, group=pg)
        if blocking:
            queue.wait_until_ready()
        return queue, handles or []

    @staticmethod
    def create_from_process_group(pg, max_chunk_bytes, max_chunks, writer_rank: int = 0,
                                  external_writer_handle=None, blocking: bool = True) -> "MessageQueue":
        """vLLM's: one writer (`writer_rank` of `pg`), every other rank a reader (shared memory on the
        writer's node, TCP elsewhere); the handle travels over `pg`. A collective call."""
        import torch.distributed as dist
        from torch.distributed import ProcessGroup
        from vllm.distributed.parallel_state import in_the_same_node_as

        if isinstance(pg, ProcessGroup):
            group_rank, world = dist.get_rank(pg), dist.get_world_size(pg)
            global_ranks = dist.get_process_group_ranks(pg)
        else:
            group_rank, world, global_ranks = pg.rank, pg.world_size, list(range(pg.world_size))
        status = in_the_same_node_as(pg, source_rank=writer_rank)
        if group_rank == writer_rank:
            if external_writer_handle is not None:
                queue = MessageQueue.create_from_handle(external_writer_handle, group_rank)
            else:
                local = [i for i, same in enumerate(status) if same and i != writer_rank]
                remote = [i for i, same in enumerate(status) if not same]
                queue = MessageQueue(n_reader=world - 1, n_local_reader=len(local), local_reader_ranks=local,
                                     max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks,
                                     remote_reader_ranks=remote)
            handle = queue.export_handle()
            if isinstance(pg, ProcessGroup):
                dist.broadcast_object_list([handle], src=global_ranks[writer_rank], group=pg)
            else:
                pg.broadcast_obj(handle, writer_rank)
        else:
            if isinstance(pg, ProcessGroup):
                recv = [None]
                dist.broadcast_object_list(recv, src=global_ranks[writer_rank], group=pg)
                handle = recv[0]
            else:
                handle = pg.broadcast_obj(None, writer_rank)
            queue = MessageQueue.create_from_handle(handle, group_rank)
        if blocking:
            queue.wait_until_ready()
        return queue


__all__ = ["BadHandleError", "ClosedError", "DeadPeerError", "Handle", "MessageQueue", "RING_CHUNK_CAP"]
