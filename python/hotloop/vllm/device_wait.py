"""The GPU worker's wait for a step's sampled tokens, on hotloop's StepNotifier instead of a CUDA event.

Contract:

- On where ``HOTLOOP_VLLM_DEVICE_WAIT=1`` (1/true/yes/on) in the workers' environment, with the plugin on
  (``HOTLOOP_VLLM=1``); off by default. vLLM's GPU worker copies each step's sampled tokens to the host on a side
  stream, records a ``torch.cuda.Event(blocking=True)`` after the copy and, in ``get_output()``, calls
  ``synchronize()`` on it. Both of vLLM's GPU model runners do so, each with its own classes (:data:`RUNNERS`):
  Model Runner V1 (``vllm.v1.worker.gpu_model_runner``: ``AsyncGPUModelRunnerOutput`` and
  ``AsyncGPUPoolingModelRunnerOutput``, the stream passed as ``async_output_copy_stream``, the event in
  ``async_copy_ready_event``) and Model Runner V2, vLLM 0.32's GPU default wherever Triton is installed
  (``vllm.v1.worker.gpu.async_utils``: ``AsyncOutput`` and ``AsyncPoolingOutput``, ``copy_stream``,
  ``copy_event``); ``VLLM_USE_V2_MODEL_RUNNER=0`` puts the workers on V1. In vLLM 0.32 and 0.33 (read from their
  source) that event is a blocking-sync one (the driver sleeps the thread until the device's interrupt), so the
  worker does not spin there; what this changes is who wakes it: the driver's blocking wait, or hotloop's park
  rung from the stream's host callback, with the GIL released either way.
- ``install()`` wraps the four classes' ``__init__``: after vLLM's, it marks a token of this process's
  ``hotloop.cuda.StepNotifier`` (``stream_callback``, created on first use in the worker's thread, whose CUDA
  context is current) on the same side stream, after the copy and the event, and puts a ``NotifiedEvent`` in the
  instance's event attribute: its ``synchronize()`` waits for that token (spin, yield, park; GIL released), its
  other attributes are the event's. vLLM's ``get_output()`` runs unchanged. A step that failed on the device
  raises the notifier's StepError with the driver's message where vLLM's event would raise its CUDA error.
- A class is wrapped only if it has the shape of one of :data:`RUNNERS` (its ``__init__`` takes the stream
  parameter and sets the event attribute, its ``get_output()`` reads it); ``wrap_init`` raises RuntimeError for
  any other. Where a runner's module or classes are missing or of another shape, ``install()`` wraps none of that
  runner's classes and logs a WARNING naming the runner and the vLLM version (its workers keep vLLM's event
  wait); the other runner is still wrapped.
- Without a usable CUDA driver (vLLM's CPU build, a machine without a GPU) ``install()`` changes nothing and
  returns False; ``uninstall()`` puts vLLM's ``__init__`` back.
- Unmeasured on a GPU so far: ``benchmarks/gpu_check.sh`` has the step that measures the worker's host CPU while
  decoding with and without it, on each runner.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import threading

from hotloop.vllm.class_patches import ClassPatches

ENV = "HOTLOOP_VLLM_DEVICE_WAIT"


@dataclasses.dataclass(frozen=True)
class Runner:
    """One of vLLM's GPU model runners, as this module sees it: where its async output classes are and their shape."""

    name: str  # "V1", "V2": vLLM's names, "Model Runner V1/V2"
    module: str
    classes: tuple[str, ...]  # the sampled-token output and its pooling twin
    stream: str  # the __init__ parameter that is the side stream the copy is enqueued on
    event: str  # the attribute holding the event recorded after the copy; get_output() synchronizes on it
    select: str  # vLLM's switch that puts the workers on this runner


RUNNERS = (
    Runner("V1", "vllm.v1.worker.gpu_model_runner", ("AsyncGPUModelRunnerOutput", "AsyncGPUPoolingModelRunnerOutput"),
           "async_output_copy_stream", "async_copy_ready_event", "VLLM_USE_V2_MODEL_RUNNER=0"),
    Runner("V2", "vllm.v1.worker.gpu.async_utils", ("AsyncOutput", "AsyncPoolingOutput"),
           "copy_stream", "copy_event", "VLLM_USE_V2_MODEL_RUNNER=1"),
)
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


def _names(fn) -> tuple[str, ...]:
    """The global and attribute names a function's code reads or sets (() for one without Python code)."""
    return getattr(getattr(fn, "__code__", None), "co_names", ())


def shape(cls) -> tuple[str, str]:
    """(stream parameter, event attribute) of the runner in :data:`RUNNERS` whose output class ``cls`` is shaped
    like; RuntimeError saying what it lacks otherwise."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    reads = _names(getattr(cls, "get_output", None))
    for r in RUNNERS:
        if r.stream in params and r.event in _names(cls.__init__) and r.event in reads:
            return r.stream, r.event
    known = "; ".join(f"{r.name}: an __init__ taking {r.stream} that sets self.{r.event}, which get_output() reads"
                      for r in RUNNERS)
    raise RuntimeError(f"{cls.__module__}.{cls.__qualname__} has the shape of no output class {ENV} knows ({known}): "
                       f"this vLLM's worker is not one {ENV} was written for; unset {ENV}")


def wrap_init(cls) -> None:
    """Wrap `cls.__init__` (a class of the shape of one of :data:`RUNNERS`: see :func:`shape`) as the contract
    says."""
    stream_param, event_attr = shape(cls)
    real_init = cls.__init__
    signature = inspect.signature(real_init)

    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        stream = kwargs[stream_param] if stream_param in kwargs else \
            signature.bind(self, *args, **kwargs).arguments[stream_param]  # vLLM passes it by name: rarely bound
        n = notifier()
        setattr(self, event_attr, NotifiedEvent(getattr(self, event_attr), n, n.mark(stream)))

    _patches.set(cls, "__init__", __init__)


def _wrap_runner(runner: Runner) -> None:
    """Wrap all of ``runner``'s classes or none (ImportError, AttributeError or RuntimeError says why not)."""
    module = importlib.import_module(runner.module)
    classes = [getattr(module, name) for name in runner.classes]
    for cls in classes:
        shape(cls)
    for cls in classes:
        wrap_init(cls)


def install() -> bool:
    """Wrap the async output classes of vLLM's runners (where asked and a CUDA driver is usable). Returns whether
    any runner's are wrapped."""
    if not requested():
        return False
    if _patches:
        return True
    from hotloop import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        log.info("hotloop: %s=1 but no CUDA driver here (%s); the worker keeps vLLM's event wait", ENV, reason)
        return False
    refused = {}
    for runner in RUNNERS:
        try:
            _wrap_runner(runner)
        except (ImportError, AttributeError, RuntimeError) as e:
            refused[runner] = e
    covered = [r for r in RUNNERS if r not in refused]
    for runner, why in refused.items():
        from hotloop.vllm import vllm_version

        other = (f"; {covered[0].select} puts the workers on Model Runner {covered[0].name}, which it covers"
                 if covered else f"; unset {ENV}: it changes nothing on this vLLM")
        log.warning("hotloop: %s=1 cannot cover vLLM %s's Model Runner %s (%s: %s): a worker on it keeps vLLM's "
                    "event wait%s", ENV, vllm_version(), runner.name, type(why).__name__, why, other)
    if covered:
        log.info("hotloop: the worker waits for each step's sampled tokens on a hotloop StepNotifier (%s; Model "
                 "Runner %s) in process %d", ENV, " and ".join(r.name for r in covered), os.getpid())
    return bool(_patches)


def uninstall() -> None:
    _patches.restore()


__all__ = ["ENV", "RUNNERS", "NotifiedEvent", "Runner", "install", "notifier", "requested", "shape", "uninstall",
           "wrap_init"]
