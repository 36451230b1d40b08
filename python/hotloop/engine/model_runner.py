"""ModelRunner: one rank's model and KV caches on its device; it launches a step and, on the output rank
(rank 0), samples its tokens.

On CUDA the runner owns a stream and a ``hotloop.cuda.StepNotifier`` (``notifier``): ``launch`` enqueues the
step's kernels, the device argmax and non-blocking copies of the sampled tokens (and, if a request draws, its
logits) into pinned host memory, all on the runner's stream, then ``mark(stream)``; the driver completes the
token once the stream gets there (a fault fails it with the driver's message), so ``notifier.done(token)`` means
the tokens are in host memory. On the CPU ``launch`` runs the step and ``notifier`` is None. ``StepOutput`` holds
a launched step's tokens until they are read.
"""

from __future__ import annotations

import torch

from hotloop.engine.model import GREEDY_TEMPERATURE, ModelConfig, Transformer, sample
from hotloop.engine.scheduler import SchedulerOutput


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
    """One rank's model and KV caches on its device (the module's contract)."""

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

