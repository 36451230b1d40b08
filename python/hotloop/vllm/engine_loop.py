"""The engine-core loop: vLLM's engine core handles its inputs while a step runs, in one hotloop wait.

Contract:

- What vLLM does (0.32, ``vllm/v1/engine/core.py``): ``step()`` sends a step to the workers and blocks in
  ``future.result()`` until rank 0 answers (``step_with_batch_queue()`` the same on the oldest batch); a request
  that reaches the engine core meanwhile waits in its ``input_queue`` until the step is over.
- What ``install()`` changes, in the engine-core process only (``EngineCoreProc``; the data-parallel engine core
  keeps vLLM's loop): its ``input_queue`` is an :class:`EngineInputQueue` (the ``queue.Queue`` calls vLLM makes
  on it, over a hotloop ``InputQueue``, so it is a wait source), and while the main thread is inside an engine
  step, a blocking ``result()`` of the multiprocess executor's ``FutureWrapper`` waits in one ``wait_any`` over
  the response queue(s) that future reads and the input queue, GIL released while parked. Each input is handled
  as it arrives, with vLLM's own ``_handle_client_request`` in arrival order, as vLLM handles it between steps:
  an ADD goes into the scheduler's waiting queue (scheduled from the next step on), an ABORT finishes the request
  as ``_process_aborts_queue`` does for an abort that arrives during a step (the step's output for it is then
  skipped by ``update_from_output``, as vLLM skips it), a UTILITY call runs and answers at once (a utility that
  itself calls the executor blocks in vLLM's own ``result()``, which first drains the step in flight: vLLM's
  FIFO of futures keeps the order), EXECUTOR_FAILED raises vLLM's "Executor failed." (the engine core then
  reports the engine dead, as it does between steps), WAKEUP (a shutdown signal) is a no-op: the step finishes,
  then vLLM's loop shuts down as before.
- The future's own deadline (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` for a step) is kept: when it passes the
  future reads its queue with no time left and fails with vLLM's "RPC call to ... timed out." A response queue
  that is shut down (the executor's monitor does that when a worker dies) wakes the wait and the future fails as
  it would in vLLM. Where the response queues are not hotloop's, or the future's queues cannot be found, vLLM's
  blocking ``result()`` runs unchanged.
- Nothing polls: the wait parks on the response rings' and the input queue's doorbells. Its policy is paced
  (``WaitPolicy(paced=True)``; ``HOTLOOP_VLLM_PACED=0``: ``WaitPolicy()``, spin 20 us, yield 10 us, then a futex):
  anchored when the step is broadcast (the executor's ``FutureWrapper`` is stamped as it is made, right after
  ``rpc_broadcast_mq.enqueue``), it learns how long a step takes from broadcast to answer, sleeps on a timer until
  shortly before the answer is due and spins through it; an input or an early answer still wakes it at once
  (``step_wait.py`` has the figures). Every wait for the same step is anchored at that step's broadcast, so the
  wait for a second rank's answer after the first one's spins through the same window instead of sleeping.

- With ``input_read.py`` (on with the loop) the input queue also reads the engine core's input sockets, and these
  waits park on their descriptors too: the main thread reads each request itself (``EngineInputQueue.read``).

Turned on by the plugin with ``HOTLOOP_VLLM_LOOP=1`` (see ``hotloop.vllm``); ``uninstall()`` restores vLLM's.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
import threading
import time

from hotloop._core import InputQueue, WaitPolicy, wait_any
from hotloop.vllm import step_wait as _step_wait
from hotloop.vllm.class_patches import ClassPatches
from hotloop.vllm.queue_slot import QueueSlot

_ENGINE_CORE = "vllm.v1.engine.core"
_EXECUTOR = "vllm.v1.executor.multiproc_executor"
_log = logging.getLogger("vllm.hotloop")


class EngineInputQueue:
    """The engine core's input queue: the calls of ``queue.Queue`` that vLLM makes on it (``put``,
    ``put_nowait``, ``get(block, timeout)``, ``get_nowait``, ``empty``, ``qsize``) over a hotloop ``InputQueue``,
    so ``wait_any`` can wait on it (``wait_sources()``). Unbounded, like vLLM's; ``queue.Empty`` as
    ``queue.Queue`` raises it; a blocking ``get`` waits with the GIL released. With an ``input_read.InputReader``
    attached, the engine core's input sockets feed it: each call that takes or looks first reads what the sockets
    hold, and a blocking ``get`` waits on their descriptors too."""

    def __init__(self):
        self._q = InputQueue()
        self.reader = None  # input_read.InputReader, while the main thread reads the input sockets
        _log.info("hotloop: the engine core handles its inputs while a step runs (HOTLOOP_VLLM_LOOP=1)")

    @property
    def hotloop_source(self) -> InputQueue:
        return self._q

    def attach(self, reader) -> None:
        self.reader = reader

    def wait_sources(self) -> list:
        """What a wait for the next input waits on: the queue, and the input sockets' descriptors when attached.
        Call ``read()`` first (a socket's descriptor does not fire again for messages already signalled)."""
        reader = self.reader
        return [self._q] if reader is None else [self._q, *reader.sources]

    def read(self) -> int:
        """Move a batch of what the input sockets hold into the queue, decoded: how many messages it took (0: the
        sockets held nothing, or there is no reader)."""
        reader = self.reader
        return 0 if reader is None else reader.read(self._q.put)

    def take_queued(self):
        """The oldest item already in the queue, without reading the sockets; queue.Empty if none."""
        return self._q.get_nowait()

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        self._q.put(item)

    def put_nowait(self, item) -> None:
        self._q.put(item)

    def get(self, block: bool = True, timeout: float | None = None):
        if not block:
            return self.get_nowait()
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if self.reader is None:
            return self._q.get(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = self.read()
            try:
                return self._q.get_nowait()
            except queue.Empty:
                if taken:  # all answered or dropped, and there may be more: read again before any wait
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise
            wait_any(self.wait_sources(), timeout=left)

    def _read_if_empty(self) -> None:
        if self.reader is not None and self._q.empty():
            self.read()

    def get_nowait(self):
        self._read_if_empty()
        return self._q.get_nowait()

    def drain(self) -> list:
        self.read()
        return self._q.drain()

    def empty(self) -> bool:
        self._read_if_empty()
        return self._q.empty()

    def qsize(self) -> int:
        self.read()
        return self._q.qsize()

    def full(self) -> bool:
        return False


def _response_of(future) -> tuple[list, float | None] | None:
    """The response queues a vLLM ``FutureWrapper`` reads and its deadline (monotonic), from its ``get_response``
    closure (``response_mqs``, ``deadline`` in vLLM 0.32's ``collective_rpc``); None when they are not there or
    not hotloop's queues."""
    fn = getattr(future, "get_response", None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return None
    try:
        env = {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return None
    mqs, deadline = env.get("response_mqs"), env.get("deadline")
    if mqs is None or not all(hasattr(mq, "hotloop_source") for mq in mqs):
        return None
    return list(mqs), deadline


class StepWait:
    """One engine core's wait for step output: waits on the response queues and the input queue, handles inputs
    as they come. Main thread only."""

    def __init__(self, core):
        self.core = core
        self.inputs = core.input_queue
        self.thread = threading.get_ident()
        self.policy = WaitPolicy(paced=_step_wait.paced_enabled())
        self.busy = False  # inside wait_for: a nested result() (a utility calling the executor) blocks as vLLM's
        self.inputs_in_step = 0  # inputs handled while a step ran (tests and the bench read it)

    def wait_for(self, future) -> None:
        """Return once `future` is done, handling the engine core's inputs meanwhile. vLLM's FIFO of futures is
        kept: the oldest pending future is resolved first, as vLLM's ``result()`` does."""
        fifo = future.futures_queue
        self.busy = True
        try:
            while not future.done():
                head = fifo[-1]
                found = _response_of(head)
                if found is None:  # not a future this loop understands: vLLM's own wait
                    return
                mqs, deadline = found
                pending = [mq for mq in mqs if not mq.hotloop_source.ready()]
                left = None if deadline is None else deadline - time.monotonic()
                if not pending or (left is not None and left <= 0):
                    fifo.pop()._wait_for_response()  # its answer is there (or it is shut down / out of time)
                    continue
                sent = getattr(head, "_hotloop_sent_ns", None)
                if sent is not None:
                    self.policy.anchor(sent)  # the answer is due a step after the broadcast
                if self.inputs.read():  # the input sockets' messages, read before their descriptors are waited on
                    self._handle_inputs()
                    continue
                sources = self.inputs.wait_sources()
                ready = wait_any([*sources, *pending], timeout=left, policy=self.policy)
                if any(s in ready for s in sources):
                    self._handle_inputs()
            self.inputs.read()  # an abort that came with the answer reaches aborts_queue before vLLM's step reads it
        finally:
            self.busy = False

    def _handle_inputs(self) -> None:
        # What is queued now, one at a time (a batch of the sockets' messages, read before): an input that raises
        # (EXECUTOR_FAILED) leaves the ones behind it queued.
        handle, take = self.core._handle_client_request, self.inputs.take_queued
        while True:
            try:
                request_type, request = take()
            except queue.Empty:
                return
            self.inputs_in_step += 1
            handle(request_type, request)


_local = threading.local()  # .wait: the StepWait of the engine step running on this thread
_patches = ClassPatches()  # what install() replaced


def _in_step(process_engine_step):
    @functools.wraps(process_engine_step)
    def wrapper(self, *args, **kwargs):
        step_wait = self.__dict__.get("_hotloop_step_wait")
        if step_wait is None:  # the first step: decide once per engine core
            step_wait = StepWait(self) if not _dp_engine_core(self) else False
            self.__dict__["_hotloop_step_wait"] = step_wait
        if step_wait is False:
            return process_engine_step(self, *args, **kwargs)
        _local.wait = step_wait
        try:
            return process_engine_step(self, *args, **kwargs)
        finally:
            _local.wait = None

    wrapper.__hotloop__ = True
    return wrapper


def _dp_engine_core(core) -> bool:
    dp = getattr(sys.modules.get(_ENGINE_CORE), "DPEngineCoreProc", None)
    return dp is not None and isinstance(core, dp)


def _waiting_result(result):
    @functools.wraps(result)
    def wrapper(self, timeout=None):
        step_wait = getattr(_local, "wait", None)
        if (timeout is None and step_wait is not None and not step_wait.busy and not self.done()
                and step_wait.thread == threading.get_ident()):
            step_wait.wait_for(self)
        return result(self, timeout)

    wrapper.__hotloop__ = True
    return wrapper


def _stamped_init(init):
    """FutureWrapper.__init__ that notes when the future was made: vLLM's collective_rpc makes it right after it
    broadcast the call, so it is when the workers got the step (the paced wait's anchor)."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        self._hotloop_sent_ns = time.monotonic_ns()
        init(self, *args, **kwargs)

    wrapper.__hotloop__ = True
    return wrapper


def in_step() -> bool:
    """Whether this thread is handling inputs while an engine step runs (inside the loop's wait)."""
    step_wait = getattr(_local, "wait", None)
    return bool(step_wait and step_wait.busy)


def loop_state(core) -> dict:
    """A vLLM utility method of the engine core while installed (``call_utility_async("hotloop_loop_state")``):
    whether this call was handled while a step ran, how many inputs the loop has handled during steps, how many
    messages the main thread read from the input sockets itself (``input_read.py``; 0 where vLLM's input thread
    reads them), the scheduler's unfinished requests, and how the outputs went out (``output_send.counts``)."""
    from hotloop.vllm import output_send

    step_wait = core.__dict__.get("_hotloop_step_wait")
    reader = getattr(core.__dict__.get("input_queue"), "reader", None)
    return {"in_step": in_step(), "inputs_in_step": step_wait.inputs_in_step if step_wait else 0,
            "inputs_read_by_main": reader.messages if reader is not None else 0,
            "unfinished": core.scheduler.get_num_unfinished_requests(), "outputs": output_send.counts(core)}


def install() -> None:
    """Turn the loop on in this process (idempotent). Needs vLLM's engine-core and multiprocess-executor modules."""
    import importlib

    core = importlib.import_module(_ENGINE_CORE)
    executor = importlib.import_module(_EXECUTOR)
    proc, future = core.EngineCoreProc, executor.FutureWrapper
    if getattr(proc.__dict__.get("_process_engine_step"), "__hotloop__", False):
        return
    _patches.set(proc, "input_queue", QueueSlot("input_queue", EngineInputQueue))
    _patches.set(proc, "_process_engine_step", _in_step(proc.__dict__["_process_engine_step"]))
    _patches.set(proc, "hotloop_loop_state", loop_state)
    _patches.set(future, "result", _waiting_result(future.__dict__["result"]))
    if "__init__" in future.__dict__:  # without it, the paced wait anchors at the previous answer instead
        _patches.set(future, "__init__", _stamped_init(future.__dict__["__init__"]))


def uninstall() -> None:
    """Put vLLM's loop back (engine cores built meanwhile keep their EngineInputQueue, which behaves as
    queue.Queue)."""
    _patches.restore()


def is_installed() -> bool:
    core = sys.modules.get(_ENGINE_CORE)
    return core is not None and getattr(core.EngineCoreProc.__dict__.get("_process_engine_step"), "__hotloop__", False)


__all__ = ["EngineInputQueue", "StepWait", "in_step", "install", "is_installed", "uninstall"]
