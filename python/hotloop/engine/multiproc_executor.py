"""MultiprocExecutor: worker processes (one per tensor-parallel rank) driven through hotloop MessageQueues.

Contract: each step's scheduler output is broadcast to every worker through one ``MessageQueue``; rank 0 (the
output rank) sends the sampled tokens back through a response ``MessageQueue`` whose reader is the engine's
wait source. On CUDA (``device``; rank r runs on GPU r modulo the GPUs present) rank 0 launches its step, marks
its ``hotloop.cuda.StepNotifier`` after the copy of the sampled tokens to pinned host memory, and waits for its
own step on the notifier (``wait``: GIL released, spin -> yield -> park) before it answers; on the CPU its step
runs synchronously and it answers at once. With tp > 1 the workers shard the model and all-reduce through
torch.distributed (gloo on CPU; NCCL when every rank has a GPU of its own), so a step needs every worker. A GPU
fault in a step is a StepError in rank 0, which exits: the engine sees a dead worker. A monitor thread waits on
the workers' process sentinels (no polling); a worker that dies sets the ``failed`` flag (also a wait source) and
the next poll / wait raises ExecutorError naming it, within milliseconds. Workers die with the engine process
(PR_SET_PDEATHSIG) and exit when the broadcast queue shuts down or its writer dies. ``shutdown()`` escalates:
queue shutdown, then SIGTERM, then SIGKILL, and joins every worker; no process or /dev/shm segment is left.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import threading
import traceback

from hotloop import MessageQueue
from hotloop._core import ClosedError, DeadPeerError, Flag, wait_any
from hotloop.engine.executor import ExecutorError, ModelRunner
from hotloop.engine.lifecycle import die_with_parent, stop_processes
from hotloop.engine.model import ModelConfig
from hotloop.engine.scheduler import SchedulerOutput

CTX = mp.get_context("spawn")  # workers start clean: no inherited threads, locks or torch state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(device: str, rank: int) -> str:
    if device != "cuda":
        return device
    import torch

    return f"cuda:{rank % torch.cuda.device_count()}"


def _worker_main(rank: int, world_size: int, config: ModelConfig, bcast_handle, dist_port: int, conn,
                 parent_pid: int, step_delay_s: float, device: str = "cpu"):
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the engine, which stops the workers
    own_gpus = device == "cuda"  # one GPU per rank when there are enough (NCCL cannot share one between ranks)
    device = _rank_device(device, rank)
    all_reduce = None
    if world_size > 1:
        import torch
        import torch.distributed as dist

        own_gpus = own_gpus and torch.cuda.device_count() >= world_size
        dist.init_process_group("nccl" if own_gpus else "gloo", init_method=f"tcp://127.0.0.1:{dist_port}",
                                rank=rank, world_size=world_size)
        all_reduce = dist.all_reduce
    runner = ModelRunner(config, rank, world_size, all_reduce, step_delay_s, device)
    bcast = MessageQueue.create_from_handle(bcast_handle, rank)
    response = MessageQueue(1, max_chunk_bytes=1 << 20) if rank == 0 else None
    conn.send(response.export_handle() if response else None)
    if response:
        response.wait_until_ready(60)
    try:
        while True:
            try:
                task = bcast.dequeue()
            except (ClosedError, DeadPeerError):
                return
            tokens = runner.execute(task)  # rank 0 on CUDA: waits on its step notifier (GIL released)
            if response:
                response.enqueue(tokens)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # the engine sees the exit through the process sentinel
    finally:
        if response:
            response.close()
        bcast.close()


class MultiprocExecutor:
    def __init__(self, config: ModelConfig, tp: int = 1, step_delay_s: float = 0.0, start_timeout: float = 120,
                 device: str = "cpu"):
        """``device``: "cpu", "cuda" (rank r on GPU r modulo the GPUs present) or "cuda:N" (every rank there);
        resolve "auto" first (executor.resolve_device)."""
        if step_delay_s and device != "cpu":
            raise ValueError("step_delay_s (a test aid: the worker sleeps in each step) works on device='cpu' only")
        self.tp = tp
        self.device = device
        self.notifier = None  # the workers hold the step notifiers; the engine waits on the response queue
        self.failed = Flag()
        self.error: str | None = None
        self._bcast = MessageQueue(tp, max_chunk_bytes=1 << 20)
        port = _free_port()
        self._procs, conns = [], []
        for rank in range(tp):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_worker_main, name=f"hotloop-worker-{rank}", daemon=True,
                            args=(rank, tp, config, self._bcast.export_handle(), port, child, os.getpid(),
                                  step_delay_s, device))
            p.start()
            child.close()
            self._procs.append(p)
            conns.append(parent)
        try:
            handles = [self._await_ready(rank, conn, start_timeout) for rank, conn in enumerate(conns)]
            self._response = MessageQueue.create_from_handle(handles[0], 0)
            self._bcast.wait_until_ready(start_timeout)
        except BaseException:
            self._stop()
            raise
        for c in conns:
            c.close()
        self.sources = [self._response, self.failed]
        self._stopping = False
        self._monitor = threading.Thread(target=self._watch_workers, name="hotloop-worker-monitor", daemon=True)
        self._monitor.start()

    def _await_ready(self, rank: int, conn, timeout: float):
        """What worker `rank` sends once it serves (rank 0: the response queue's handle); every rank reports,
        so a worker that fails to start is named here instead of hanging the others."""
        proc = self._procs[rank]
        if conn not in mpc.wait([conn, proc.sentinel], timeout=timeout):
            raise ExecutorError(f"worker rank {rank} did not start within {timeout} s (exit code {proc.exitcode}); "
                                "see its output above")
        try:
            return conn.recv()
        except EOFError:
            proc.join(5)
            raise ExecutorError(f"worker rank {rank} exited during start-up (exit code {proc.exitcode}); "
                                "see its output above") from None

    def _watch_workers(self):
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs)}
        dead = mpc.wait(list(sentinels))
        if self._stopping:
            return
        rank, p = sentinels[dead[0]]
        p.join(0.1)
        code = p.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self.error = f"worker rank {rank} (pid {p.pid}) {how}; the engine cannot run more steps"
        self.failed.set()

    def _check(self):
        if self.failed.is_set():
            raise ExecutorError(self.error)

    def submit(self, out: SchedulerOutput) -> None:
        self._check()
        try:
            self._bcast.enqueue(out, timeout=60)
        except (DeadPeerError, TimeoutError) as e:
            raise ExecutorError(f"cannot send the step to the workers: {e}") from e

    def poll(self):
        if self._response.readable():
            return self._response.dequeue(timeout=0) or []
        self._check()
        return None

    def wait(self, timeout: float | None = None):
        if not wait_any(self.sources, timeout=timeout):
            raise TimeoutError(f"no step result within {timeout} s")
        result = self.poll()
        if result is None:
            self._check()
        return result

    def _stop(self):
        self._stopping = True
        self._bcast.shutdown()
        stop_processes(self._procs, grace_s=5, term_s=2)
        self._bcast.close()

    def shutdown(self) -> None:
        if not self._procs:
            return
        self._stop()
        self._response.close()
        self._procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]
