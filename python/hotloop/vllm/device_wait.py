"""The GPU worker's wait for a step's sampled tokens, on hotloop's StepNotifier instead of a CUDA event.

Contract:

- On where ``HOTLOOP_VLLM_DEVICE_WAIT=1`` (1/true/yes/on) in the workers' environment, with the plugin on
  (``HOTLOOP_VLLM=1``); off by default. vLLM's GPU worker copies each step's sampled tokens to the host on a side
  stream (``AsyncGPUModelRunnerOutput``, and ``AsyncGPUPoolingModelRunnerOutput`` for pooling models), records a
  ``torch.cuda.Event(blocking=True)`` after the copy and, in ``get_output()``, calls ``synchronize()`` on it. In
  vLLM 0.32 and 0.33 (read from their source) that event is a blocking-sync one (the driver sleeps the thread until
  the device's interrupt), so the worker does not spin there; what this changes is who wakes it: the driver's
  blocking wait, or hotloop's park rung from the stream's host callback, with the GIL released either way.
- ``install()`` wraps both classes' ``__init__``: after vLLM's, it marks a token of this process's
  ``hotloop.cuda.StepNotifier`` (``stream_callback``, created on first use in the worker's thread, whose CUDA
  context is current) on the same side stream, after the copy, and puts a ``NotifiedEvent`` in the instance's
  ``async_copy_ready_event``: its ``synchronize()`` waits for that token (spin, yield, park; GIL released), its
  other attributes are the event's. vLLM's ``get_output()`` runs unchanged. A step that failed on the device
  raises the notifier's StepError with the driver's message where vLLM's event would raise its CUDA error.
- Without a usable CUDA driver (vLLM's CPU build, a machine without a GPU) ``install()`` changes nothing and
  returns False; ``uninstall()`` puts vLLM's ``__init__`` back.
- Unmeasured on a GPU so far: ``benchmarks/gpu_check.sh`` has the step that measures the worker's host CPU while
  decoding with and without it.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading

from hotloop.vllm.class_patches import ClassPatches

ENV = "HOTLOOP_VLLM_DEVICE_WAIT"
_CLASSES = ("AsyncGPUModelRunnerOutput", "AsyncGPUPoolingModelRunnerOutput")
_RUNNER = "vllm.v1.worker.gpu_model_runner"
log = logging.getLogger("vllm.hotloop")
_patches = ClassPatches()
_local = threading.local()  # .notifier: the StepNotifier of this thread's CUDA context


def requested() -> bool:
    from hotloop.vllm import env_flag  # the plugin's reading of its switches (1/true/yes/on)

    return env_flag(ENV) is True


def notifier():
    """This thread's StepNotifier (created on first use: the thread's CUDA context must be current)."""
    n = getattr(_local, "notifier", None)
    if n is None:
        from hotloop.cuda import StepNotifier

        n = _local.notifier = StepNotifier("stream_callback")
    return n


class NotifiedEvent:
    """A CUDA event whose ``synchronize()`` waits on a StepNotifier token marked right after it on its stream."""

    __slots__ = ("event", "notifier", "token")

    def __init__(self, event, notifier, token: int):
        self.event, self.notifier, self.token = event, notifier, token

    def synchronize(self) -> None:
        self.notifier.wait(self.token)  # GIL released; raises StepError if the stream failed

    def query(self) -> bool:
        return self.notifier.done(self.token)

    def __getattr__(self, name):
        return getattr(self.event, name)


def wrap_init(cls) -> None:
    """Wrap `cls.__init__` (a class whose __init__ takes ``async_output_copy_stream`` and sets
    ``async_copy_ready_event`` after enqueueing its copy on that stream) as the contract says."""
    real_init = cls.__init__
    signature = inspect.signature(real_init)
    if "async_output_copy_stream" not in signature.parameters:
        raise RuntimeError(f"{cls.__qualname__}.__init__ takes no async_output_copy_stream: this vLLM's worker is not "
                           f"the one {ENV} knows; unset it")

    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        stream = signature.bind(self, *args, **kwargs).arguments["async_output_copy_stream"]
        n = notifier()
        self.async_copy_ready_event = NotifiedEvent(self.async_copy_ready_event, n, n.mark(stream))

    _patches.set(cls, "__init__", __init__)


def install() -> bool:
    """Wrap vLLM's async output classes (where asked and a CUDA driver is usable). Returns whether installed."""
    if not requested():
        return False
    if _patches:
        return True
    from hotloop import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        log.info("hotloop: %s=1 but no CUDA driver here (%s); the worker keeps vLLM's event wait", ENV, reason)
        return False
    import importlib

    runner = importlib.import_module(_RUNNER)
    for name in _CLASSES:
        if hasattr(runner, name):
            wrap_init(getattr(runner, name))
    log.info("hotloop: the worker waits for each step's sampled tokens on a hotloop StepNotifier (%s) in process %d",
             ENV, os.getpid())
    return bool(_patches)


def uninstall() -> None:
    _patches.restore()


__all__ = ["ENV", "NotifiedEvent", "install", "notifier", "requested", "uninstall", "wrap_init"]
