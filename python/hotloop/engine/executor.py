"""Executors run the model for the engine core: one step in flight at a time.

Contract (both executors): ``submit(scheduler_output)`` launches a step and returns at once; the step's sampled
tokens come back through ``poll()`` (non-blocking: tokens or None) or ``wait(timeout)`` (GIL released).
``sources`` are the wait_any sources that become ready when the result is there or the executor failed, so the
engine can wait on them together with its input queue. A failed executor (a worker died, the model raised)
raises ExecutorError from poll / wait, with what happened; it does not hang.

``InProcessExecutor`` runs the model in a thread of the engine process (torch releases the GIL inside its ops);
results come back on a hotloop InputQueue. ``MultiprocExecutor`` (multiproc_executor.py) runs worker processes.
"""

from __future__ import annotations

import threading
from queue import Empty

from hotloop._core import ClosedError, InputQueue, wait_any
from hotloop.engine.model import ModelConfig, Transformer, sample
from hotloop.engine.scheduler import SchedulerOutput


class ExecutorError(RuntimeError):
    """The executor cannot run steps any more (a worker died or the model raised)."""


class ModelRunner:
    """One rank's model and KV caches; runs a step and (on the output rank) samples."""

    def __init__(self, config: ModelConfig, rank: int = 0, world_size: int = 1, all_reduce=None,
                 step_delay_s: float = 0.0):
        self.model = Transformer(config, rank, world_size, all_reduce)
        self.rank = rank
        self.step_delay_s = step_delay_s  # tests: make every step last at least this long (sleeps, GIL free)

    def execute(self, out: SchedulerOutput) -> list[int] | None:
        import time

        t0 = time.monotonic()
        for rid in out.free_ids:
            self.model.free(rid)
        tokens = None
        if out.segments:
            logits = self.model.forward(out.segments)
            if self.rank == 0:
                tokens = sample(logits, out.segments)
        if self.step_delay_s:
            left = self.step_delay_s - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)
        return tokens


class InProcessExecutor:
    def __init__(self, config: ModelConfig, step_delay_s: float = 0.0):
        self.runner = ModelRunner(config, step_delay_s=step_delay_s)
        self._tasks = InputQueue()
        self._results = InputQueue()
        self.sources = [self._results]
        self._thread = threading.Thread(target=self._run, name="hotloop-inprocess-worker", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            try:
                task = self._tasks.get()
            except ClosedError:
                return
            try:
                self._results.put(self.runner.execute(task))
            except BaseException as e:  # reported to the engine through the result
                self._results.put(ExecutorError(f"the model raised in the in-process worker: {e!r}"))

    def submit(self, out: SchedulerOutput) -> None:
        self._tasks.put(out)

    @staticmethod
    def _unwrap(result):
        if isinstance(result, ExecutorError):
            raise result
        return result or []

    def poll(self):
        try:
            return self._unwrap(self._results.get_nowait())
        except Empty:
            return None

    def wait(self, timeout: float | None = None):
        if not wait_any(self.sources, timeout=timeout):
            raise TimeoutError(f"no step result within {timeout} s")
        return self.poll()

    def shutdown(self) -> None:
        self._tasks.close()
        self._thread.join(10)
