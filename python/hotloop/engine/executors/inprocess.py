"""InProcessExecutor: the model in the engine process, its steps completed through a step notifier
(``notifier``), one code path on both devices.

- CPU (``HostStepNotifier``): ``submit`` marks a token and hands the step to the executor's step thread, which
  runs the model (torch releases the GIL inside its ops) and calls ``complete(token)``, or ``fail(token, why)``
  if the model raised.
- CUDA (``hotloop.cuda.StepNotifier``): ``submit`` launches the step from the calling thread (ModelRunner
  enqueues it on its stream and marks the notifier after the copy of the tokens to the host); the driver
  completes the token once the stream gets there. A launch only enqueues work, so no step thread is needed, as
  in a single-process GPU engine.

Either way the wait source is ``notifier.settled()`` (ready once the step in flight is done; one object for every
step) and ``poll()`` is ``notifier.done(token)`` (one atomic load); the tokens are read on the host once it is true. A failed step raises ExecutorError with the
notifier's message.
"""

from __future__ import annotations

import threading

from hotloop._core import ClosedError, HostStepNotifier, InputQueue, StepError
from hotloop.engine.executors.base import Executor
from hotloop.engine.model import ModelConfig
from hotloop.engine.model_runner import ModelRunner, StepOutput
from hotloop.engine.scheduler import SchedulerOutput
from hotloop.errors import ExecutorError


class InProcessExecutor(Executor):
    """The model in the engine process (the module's contract). ``runner``: a ModelRunner-like object to use
    instead of building one (tests); its ``notifier`` is None for a runner whose ``launch`` runs the step (CPU)."""

    def __init__(self, config: ModelConfig, tp: int = 1, step_delay_s: float = 0.0, device: str = "cpu",
                 runner=None):
        if tp != 1:
            raise ValueError("the in-process executor runs one rank; use executor='multiproc' for tp > 1")
        self.runner = runner if runner is not None else ModelRunner(config, step_delay_s=step_delay_s, device=device)
        self.device = str(self.runner.device)
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
        self.sources = [self.notifier.settled()]

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
        self.in_flight = True

    def poll(self):
        if self._token is None:
            return None
        try:
            if not self.notifier.done(self._token):
                return None
        except StepError as e:
            raise ExecutorError(str(e)) from None
        self._token = None
        self.in_flight = False
        return self._output.tokens()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._tasks.close()
            self._thread.join(10)
            self._thread = None
