"""Executors run the model for the engine core: one step in flight at a time.

Contract (both executors): ``submit(scheduler_output)`` launches a step and returns at once; ``sources`` (read
after each ``submit``: they may name the step in flight) are the wait_any sources that become ready when the step's
result is there or the executor failed, so the engine waits on them together with its input queue; the step's
sampled tokens come back through ``poll()`` (non-blocking: tokens or None) or ``wait(timeout)`` (GIL released). A
failed step or executor (a worker died, the model raised, the GPU faulted) raises ExecutorError from poll / wait,
with what happened; it does not hang.

``InProcessExecutor`` completes its steps through a step notifier (``notifier``), one code path on both devices:

- CPU (``HostStepNotifier``): ``submit`` marks a token and hands the step to the executor's step thread, which
  runs the model (torch releases the GIL inside its ops) and calls ``complete(token)``, or ``fail(token, why)``
  if the model raised.
- CUDA (``hotloop.cuda.StepNotifier``): ``submit`` launches the step from the calling thread: its kernels, the
  device argmax and non-blocking copies of the sampled tokens (and, if a request draws, its logits) into pinned
  host memory, all on the runner's stream, then ``mark(stream)``; the driver completes the token once the stream
  gets there (a fault fails it with the driver's message). A launch only enqueues work, so no step thread is
  needed, as in a single-process GPU engine.

Either way the step's wait source is ``notifier.until(token)``, ``poll()`` is ``notifier.done(token)`` (one
atomic load) and the tokens are read on the host once it is true; ``wait()`` is ``notifier.wait`` (GIL released).
``MultiprocExecutor`` (multiproc_executor.py) runs worker processes: rank 0 waits for its own step on its
notifier (CUDA) before answering, and the engine waits on the answer queue.

Devices: ``resolve_device`` turns the engine's ``device`` option ("cpu", "cuda", "cuda:N", "auto") into the device
to run on, or says why CUDA cannot be used.
"""

from __future__ import annotations

import os
import threading

import torch

from hotloop._core import ClosedError, HostStepNotifier, InputQueue, StepError
from hotloop.engine.model import GREEDY_TEMPERATURE, ModelConfig, Transformer, sample
from hotloop.engine.scheduler import SchedulerOutput

DEVICES = ("cpu", "cuda", "cuda:N", "auto")


class ExecutorError(RuntimeError):
    """The executor cannot run steps any more (a worker died, the model raised or the GPU faulted)."""


def cuda_problem() -> str | None:
    """None when the engine can run on CUDA here, else why not (torch sees no GPU, hotloop cannot open the
    driver, or hotloop opened the fake test driver, which cannot see torch's streams)."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU / driver)"
    import hotloop.cuda
    from hotloop.testing import FAKE_CUDA_LIBRARY

    why = hotloop.cuda.unavailable_reason()
    if why is not None:
        return f"hotloop cannot open the CUDA driver: {why}"
    if os.path.realpath(hotloop.cuda.driver_info()["path"]) == os.path.realpath(FAKE_CUDA_LIBRARY):
        return ("hotloop opened its fake CUDA driver ($HOTLOOP_CUDA_DRIVER), which cannot complete work on torch's "
                "streams: unset HOTLOOP_CUDA_DRIVER (in the test suite: HOTLOOP_TEST_CUDA=real)")
    return None


def resolve_device(device: str) -> str:
    """The device to run on: "cpu", or "cuda" / "cuda:N"; "auto" is CUDA when :func:`cuda_problem` finds none,
    else the CPU. Raises ValueError for an unknown name or a CUDA device that cannot be used, saying why."""
    name = str(device)
    if name == "cpu":
        return "cpu"
    if name == "auto":
        return "cuda" if cuda_problem() is None else "cpu"
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        why = cuda_problem()
        if why is not None:
            raise ValueError(f"device={name!r} cannot be used: {why}; use device='cpu' (or 'auto')")
        return name
    raise ValueError(f"device must be one of {DEVICES} (N a GPU index), got {device!r}")


class StepOutput:
    """A launched step's sampled tokens (output rank), readable with ``tokens()`` once the step is done; ``token``
    is its notifier token when the step runs asynchronously (CUDA), else None."""

    __slots__ = ("token", "_tokens", "_argmax", "_logits", "_segments")

    def __init__(self, tokens=None, token=None, argmax=None, logits=None, segments=()):
        self.token = token
        self._tokens, self._argmax, self._logits, self._segments = tokens, argmax, logits, segments

    def tokens(self) -> list:
        """The step's tokens (SampleError in place of a failed draw); [] for a step that samples nothing."""
        if self._argmax is None:
            return self._tokens or []
        return sample(self._logits, self._segments, argmax=self._argmax.tolist())


class ModelRunner:
    """One rank's model and KV caches on its device; launches a step and (on the output rank) samples.

    On CUDA the runner owns a stream and a ``hotloop.cuda.StepNotifier`` (``notifier``): ``launch`` enqueues
    everything on the stream and marks the notifier after the device-to-host copies, so ``notifier.done(token)``
    means the tokens are in host memory. On the CPU ``launch`` runs the step and ``notifier`` is None.
    """

    def __init__(self, config: ModelConfig, rank: int = 0, world_size: int = 1, all_reduce=None,
                 step_delay_s: float = 0.0, device: str = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = rank
        self.step_delay_s = step_delay_s  # tests: make every step last at least this long (sleeps, GIL free)
        self.notifier = None
        if self.device.type == "cuda":
            if step_delay_s:
                raise ValueError("step_delay_s (a test aid: the step thread sleeps) works on device='cpu' only")
            torch.cuda.set_device(self.device)
        self.model = Transformer(config, rank, world_size, all_reduce, self.device)
        if self.device.type == "cuda":
            import hotloop.cuda

            self.stream = torch.cuda.Stream(self.device)
            torch.cuda.synchronize(self.device)  # the weights are in place before the step stream reads them
            self.notifier = hotloop.cuda.StepNotifier()  # this thread's context is current: torch initialised it

    def launch(self, out: SchedulerOutput) -> StepOutput:
        """CPU: run the step here. CUDA: enqueue it on the runner's stream and mark the notifier (output rank)."""
        if self.notifier is not None:
            with torch.cuda.stream(self.stream):
                return self._launch_cuda(out)
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
        return StepOutput(tokens)

    def _launch_cuda(self, out: SchedulerOutput) -> StepOutput:
        for rid in out.free_ids:
            self.model.free(rid)  # the caching allocator reuses the blocks in this stream's order
        if not out.segments or self.rank != 0:
            if out.segments:
                self.model.forward(out.segments)
            return StepOutput([], token=self.notifier.mark(self.stream) if self.rank == 0 else None)
        logits = self.model.forward(out.segments)
        argmax = torch.empty(logits.shape[0], dtype=torch.long, pin_memory=True)
        argmax.copy_(logits.argmax(-1), non_blocking=True)
        host_logits = None
        if any(s.sample and isinstance(s.temperature, (int, float)) and s.temperature >= GREEDY_TEMPERATURE
               for s in out.segments):  # a draw runs on the host, from the logits
            host_logits = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
            host_logits.copy_(logits, non_blocking=True)
        token = self.notifier.mark(self.stream)  # after the copies: done(token) = the tokens are on the host
        return StepOutput(token=token, argmax=argmax, logits=host_logits, segments=out.segments)

    def execute(self, out: SchedulerOutput) -> list | None:
        """Launch the step and return its tokens once it is done (None off the output rank). On CUDA the wait is
        ``notifier.wait`` (GIL released); a failed step raises StepError with the driver's message."""
        step = self.launch(out)
        if self.rank != 0:
            return None
        if step.token is not None:
            self.notifier.wait(step.token)
        return step.tokens()


class InProcessExecutor:
    """The model in the engine process (see the module's contract). ``runner``: a ModelRunner-like object to use
    instead of building one (tests); its ``notifier`` is None for a runner whose ``launch`` runs the step (CPU)."""

    def __init__(self, config: ModelConfig, step_delay_s: float = 0.0, device: str = "cpu", runner=None):
        self.runner = runner if runner is not None else ModelRunner(config, step_delay_s=step_delay_s, device=device)
        self._thread = None
        if self.runner.notifier is not None:  # the launch is asynchronous; the device completes the token
            self.notifier = self.runner.notifier
        else:
            self.notifier = HostStepNotifier()
            self._tasks = InputQueue()
            self._thread = threading.Thread(target=self._run, name="hotloop-inprocess-worker", daemon=True)
            self._thread.start()
        self._token: int | None = None
        self._output: StepOutput | None = None
        self.sources: list = []

    def _run(self):
        while True:
            try:
                token, task = self._tasks.get()
            except ClosedError:
                return
            try:
                self._output = self.runner.launch(task)
            except BaseException as e:  # reported to the engine through the notifier
                self.notifier.fail(token, f"the model raised in the in-process worker: {e!r}")
            else:
                self.notifier.complete(token)

    def submit(self, out: SchedulerOutput) -> None:
        if self._thread is not None:
            token = self.notifier.mark()
            self._output = None
            self._tasks.put((token, out))
        else:
            try:
                self._output = self.runner.launch(out)
            except (StepError, RuntimeError) as e:  # torch and the driver report a broken device as RuntimeError
                raise ExecutorError(f"launching the step on {self.runner.device} failed: {e}") from e
            token = self._output.token
        self._token = token
        self.sources = [self.notifier.until(token)]

    def _done(self) -> bool:
        try:
            return self.notifier.done(self._token)
        except StepError as e:
            raise ExecutorError(str(e)) from None

    def poll(self):
        if self._token is None or not self._done():
            return None
        self._token = None
        return self._output.tokens()

    def wait(self, timeout: float | None = None):
        if self._token is None:
            raise RuntimeError("wait() without a step in flight: submit one first")
        try:
            done = self.notifier.wait(self._token, timeout=timeout)
        except StepError as e:
            raise ExecutorError(str(e)) from None
        if not done:
            raise TimeoutError(f"no step result within {timeout} s")
        return self.poll()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._tasks.close()
            self._thread.join(10)
