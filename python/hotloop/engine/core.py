"""EngineCore: the engine's hot loop. Schedules a step, launches it on the executor, and waits for its result
while requests keep arriving, in one of three wait modes (selected explicitly, for A/B):

- ``block``: wait for the step's result (GIL released); inputs are handled between steps only.
- ``poll``: while the step runs, loop in Python: poll the result (the step notifier's ``done``, or the answer
  queue), drain the input queue without blocking, ``os.sched_yield()``. Inputs are handled at once, but the loop
  holds the GIL and a core.
- ``hotloop``: one prepared ``Waiter`` (its own adaptive policy) on {the executor's sources, the input queue}, in
  C++ with the GIL released; inputs that arrive during a step reach the scheduler at once; the result is
  processed when it lands. With the in-process executor the step's source is its step notifier's ``settled()``:
  on CUDA the driver completes the step when its stream passes its mark (after the copy of the sampled tokens to
  pinned host memory), on the CPU the step thread does; the loop is the same code for both.

The model runs on ``device`` ("cpu" by default, "cuda", "cuda:N", or "auto": CUDA when torch and hotloop's driver
both see a GPU; device.resolve_device says why CUDA cannot be used).

Outputs are the same in every mode (sampling depends only on the request). Contract: ``input_queue`` takes
``AddRequest`` / ``AbortRequest`` / ``StatsRequest`` (and ``None`` or ``ShutdownRequest`` = shut down); outputs
(lists of RequestOutput, or a StatsReport) go to ``output_queue``. A bad request (any field of the wrong type or
out of range: the scheduler's ``check_request``) gets an error output and the engine goes on; one whose id is not
a str cannot be answered and is logged. A request whose draw fails (sampling returns a SampleError for it) ends
with an error output alone. An executor failure fails every request with its message and stops the loop
(``run`` then raises ExecutorError). ``stats.notifier_completions`` counts the steps the executor's step notifier
completed (in-process executor; the multi-process executor's workers hold theirs).

Metrics: while ``run`` serves, the loop thread's waits are counted in ``wait_metrics`` and exported by
hotloop.metrics under ``component="engine"``, ``wait_mode`` and ``metrics_labels`` (a replica name, say); the
in-process executor's step notifier under ``component="engine_steps"``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from hotloop import metrics
from hotloop._core import InputQueue, WaitPolicy, Waiter
from hotloop.engine.device import resolve_device
from hotloop.engine.executors import Executor, create_executor, executor_class
from hotloop.engine.model import model_config
from hotloop.engine.protocol import (AbortRequest, AddRequest, FinishReason, RequestOutput, ShutdownRequest, StatsReport,
                                     StatsRequest)
from hotloop.engine.scheduler import Scheduler
from hotloop.errors import ExecutorError, RequestError

WAIT_MODES = ("block", "poll", "hotloop")
QUEUE_WAIT_SAMPLES = 100_000  # the statistics stay bounded in an engine nobody asks for them
_log = logging.getLogger("hotloop.engine")


@dataclass
class EngineStats:
    steps: int = 0
    # input thread receive -> scheduler, per request, since the last StatsRequest (the latest QUEUE_WAIT_SAMPLES)
    queue_wait_ns: deque = field(default_factory=lambda: deque(maxlen=QUEUE_WAIT_SAMPLES))
    added_during_step: int = 0  # requests added to the scheduler while a step was running
    notifier_completions: int = 0  # steps completed by the executor's step notifier (its `completed` count)


class EngineCore:
    def __init__(self, model="tiny", executor: str | Executor = "inprocess", tp: int = 1,
                 wait_mode: str = "hotloop", max_num_seqs: int = 64, max_tokens_per_step: int = 512,
                 step_delay_s: float = 0.0, output_queue: InputQueue | None = None, device: str = "cpu",
                 executor_options: dict | None = None):
        """``executor``: a registered executor's name ("inprocess", "multiproc", ...: executors.executor_names())
        made with ``executor_options``, or an Executor object (its own device)."""
        if wait_mode not in WAIT_MODES:
            raise ValueError(f"wait_mode must be one of {WAIT_MODES}, got {wait_mode!r}")
        self.config = model_config(model)
        self.wait_mode = wait_mode
        # the step's wait, per mode: a table, so each mode's wait is found by name
        self._wait_for_step = {"block": self._wait_block, "poll": self._wait_poll,
                               "hotloop": self._wait_hotloop}[wait_mode]
        if isinstance(executor, Executor):
            self.executor = executor
            self.device = executor.device
        else:
            executor_class(executor)  # an unknown name fails before the device is resolved
            self.device = resolve_device(device)
            self.executor = create_executor(executor, self.config, tp=tp, step_delay_s=step_delay_s,
                                            device=self.device, **(executor_options or {}))
        self.scheduler = Scheduler(self.config.vocab_size, self.config.max_seq_len, max_num_seqs,
                                   max_tokens_per_step)
        self.input_queue = InputQueue()
        self.output_queue = output_queue if output_queue is not None else InputQueue()
        self.stats = EngineStats()
        # hotloop mode: one prepared wait over {the executor's sources, the input queue}, with its own adaptive
        # policy (the spin budget follows how long this loop's waits last)
        self.wait_policy = WaitPolicy(adaptive=True)
        self._waiter = None
        self.wait_metrics = metrics.WaitMetrics()
        self.metrics_labels: dict[str, str] = {}  # more labels for this engine's metrics (replica=...)
        self._stopping = False
        self._in_step = False

    # ---- inputs ----

    def _handle(self, msg) -> None:
        try:
            self._handle_one(msg)
        except Exception:  # a message the checks did not foresee: it fails alone, the loop goes on
            _log.exception("the engine failed to handle a %s; dropped it", type(msg).__name__)
            rid = getattr(msg, "request_id", None)
            if isinstance(msg, AddRequest) and isinstance(rid, str) and rid not in self.scheduler.requests:
                self.output_queue.put([RequestOutput(rid, [], True, FinishReason.ERROR,
                                                     f"request {rid!r}: the engine could not take it (see its log)")])

    def _handle_one(self, msg) -> None:
        if msg is None or isinstance(msg, ShutdownRequest):
            self._stopping = True
        elif isinstance(msg, StatsRequest):
            st = self.stats
            self.output_queue.put(StatsReport(st.steps, list(st.queue_wait_ns), st.added_during_step,
                                                self.wait_mode))
            st.queue_wait_ns.clear()
        elif isinstance(msg, AddRequest):
            if not isinstance(msg.request_id, str):  # no client routes an answer to it: nobody to tell
                _log.error("dropped a request whose request_id is a %s, not a str (%r): nobody can be answered",
                           type(msg.request_id).__name__, msg.request_id)
                return
            try:
                self.scheduler.add(msg)
            except RequestError as e:
                self.output_queue.put([RequestOutput(msg.request_id, [], True, FinishReason.ERROR, str(e))])
                return
            if isinstance(msg.arrival_ns, int) and msg.arrival_ns:
                self.stats.queue_wait_ns.append(time.monotonic_ns() - msg.arrival_ns)
            if self._in_step:
                self.stats.added_during_step += 1
        elif isinstance(msg, AbortRequest):
            ids = msg.request_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
                _log.error("dropped an AbortRequest whose request_ids is a %s, not a list of str",
                           type(ids).__name__)
                return
            outs = self.scheduler.abort([i for i in ids if isinstance(i, str)])
            if outs:
                self.output_queue.put(outs)
        else:
            _log.error("the engine input queue got a %s; dropped it (send AddRequest, AbortRequest or StatsRequest)",
                       type(msg).__name__)

    def _drain_inputs(self) -> None:
        for msg in self.input_queue.drain():
            self._handle(msg)

    # ---- the loop ----

    def run(self) -> None:
        """Serve until a None arrives on the input queue (or the executor fails: raises ExecutorError)."""
        try:
            with self._metrics_registered():
                while not self._stopping:
                    if not self.scheduler.has_work:
                        self._handle(self.input_queue.get())  # idle: parked in C++, ~0 CPU
                        self._drain_inputs()
                        continue
                    self.step()
        finally:
            self.executor.shutdown()

    @contextmanager
    def _metrics_registered(self):
        labels = {"wait_mode": self.wait_mode, **self.metrics_labels}
        notifier = getattr(self.executor, "notifier", None)
        steps = metrics.register(lambda: notifier.stats, component="engine_steps", **labels) if notifier else None
        try:
            with metrics.counted(self.wait_metrics, component="engine", **labels):
                yield
        finally:
            if steps is not None:
                metrics.unregister(steps)

    def step(self) -> None:
        """One step: schedule, launch, wait per the mode (handling inputs as the mode allows), process."""
        sched = self.scheduler.schedule()
        self._in_step = True
        try:
            self.executor.submit(sched)
            tokens = self._wait_for_step()
        except ExecutorError as e:
            self._in_step = False
            self.output_queue.put(self.scheduler.fail_all(str(e)))
            self._stopping = True
            raise
        self._in_step = False
        self.stats.steps += 1
        notifier = getattr(self.executor, "notifier", None)
        if notifier is not None:
            self.stats.notifier_completions = notifier.completed
        outs = self.scheduler.update(tokens)
        if outs:
            self.output_queue.put(outs)
        if self.wait_mode == "block":
            self._drain_inputs()  # block handles inputs between steps only

    def _wait_block(self):
        return self.executor.wait()

    def _wait_poll(self):
        executor, inputs = self.executor, self.input_queue
        while True:
            tokens = executor.poll()
            if tokens is not None:
                return tokens
            if len(inputs):
                self._drain_inputs()
            os.sched_yield()

    def _wait_hotloop(self):
        executor, inputs = self.executor, self.input_queue
        if self._waiter is None:  # the executor's sources are the same objects for its life
            self._waiter = Waiter([*executor.sources, inputs], self.wait_policy)
        while True:
            ready = self._waiter.wait()
            if ready and ready[-1] is inputs:
                self._drain_inputs()
                if len(ready) == 1:
                    continue
            tokens = executor.poll()
            if tokens is not None:
                return tokens
