"""MultiprocExecutor: the ranks in worker processes on this node (multiprocessing, spawned), driven through
hotloop MessageQueues in shared memory (WorkerGroupExecutor's contract; the worker loop is worker.py's).

Devices: "cpu", "cuda" (rank r on GPU r modulo the GPUs present) or "cuda:N" (every rank there). A monitor
thread waits on the workers' process sentinels (no polling); a worker that dies fails the executor naming its
rank and how it ended. Workers die with the engine process (PR_SET_PDEATHSIG) and exit when the broadcast queue
shuts down or its writer dies. ``shutdown()`` escalates: queue shutdown, then SIGTERM, then SIGKILL, and joins
every worker; no process or /dev/shm segment is left.
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
from hotloop.engine.executors.worker import serve_steps, start_rank
from hotloop.engine.executors.worker_group import STEP_CHUNK_BYTES, WorkerGroupExecutor
from hotloop.stage_process.lifecycle import die_with_parent, stop_processes
from hotloop.engine.model import ModelConfig
from hotloop.errors import ExecutorError

CTX = mp.get_context("spawn")  # workers start clean: no inherited threads, locks or torch state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, config: ModelConfig, bcast_handle, init_method: str, conn,
                 parent_pid: int, step_delay_s: float, device: str):
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the engine, which stops the workers
    runner = start_rank(rank, world_size, config, init_method, step_delay_s, device)
    bcast = MessageQueue.create_from_handle(bcast_handle, rank)
    response = MessageQueue(1, max_chunk_bytes=STEP_CHUNK_BYTES) if rank == 0 else None
    conn.send(response.export_handle() if response else None)
    if response:
        response.wait_until_ready(60)
    try:
        serve_steps(runner, bcast, response)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # the engine sees the exit through the process sentinel
    finally:
        if response:
            response.close()
        bcast.close()


class MultiprocExecutor(WorkerGroupExecutor):
    def __init__(self, config: ModelConfig, tp: int = 1, step_delay_s: float = 0.0, device: str = "cpu",
                 start_timeout: float = 120):
        """``device``: resolved ("cpu", "cuda" or "cuda:N"; see hotloop.engine.device.resolve_device)."""
        if step_delay_s and device != "cpu":
            raise ValueError("step_delay_s (a test aid: the worker sleeps in each step) works on device='cpu' only")
        super().__init__(tp, device)
        self._monitor = None
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._procs, conns = [], []
        for rank in range(tp):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_worker_main, name=f"hotloop-worker-{rank}", daemon=True,
                            args=(rank, tp, config, self._bcast.export_handle(), init_method, child, os.getpid(),
                                  step_delay_s, device))
            p.start()
            child.close()
            self._procs.append(p)
            conns.append(parent)
        try:
            handles = [self._await_ready(rank, conn, start_timeout) for rank, conn in enumerate(conns)]
            self._connect(handles[0], start_timeout)
        except BaseException:
            self.shutdown()
            raise
        finally:
            for c in conns:
                c.close()
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
        rank, p = sentinels[dead[0]]
        p.join(0.1)
        code = p.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self._fail(f"worker rank {rank} (pid {p.pid}) {how}; the engine cannot run more steps")

    def _stop_workers(self) -> None:
        stop_processes(self._procs, grace_s=5, term_s=2)
        if self._monitor is not None:
            self._monitor.join()  # it saw a worker exit; then the processes can be released
        for p in self._procs:
            p.close()  # its sentinel descriptor
        self._procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]
