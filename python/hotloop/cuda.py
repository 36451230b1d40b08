"""CUDA step completion, and whether a CUDA driver is usable here.

The driver (``libcuda.so.1``, or ``$HOTLOOP_CUDA_DRIVER``) is opened on first use; hotloop never links it, so
this module imports everywhere and :func:`is_available` answers cleanly on machines without a GPU.

:class:`StepNotifier` makes "step N is done" a source like any other: ``mark(stream)`` after a step's work is
enqueued returns a token; ``done(token)`` is one atomic load (no GIL, no driver call); ``wait(token)`` waits
with the GIL released; ``until(token)`` goes into :func:`hotloop.wait_any` with the engine's other sources.
On CPU-only engines, :class:`hotloop.HostStepNotifier` has the same interface, completed by a worker thread.
"""

from hotloop._core import (
    CudaError,
    CudaUnavailableError,
    StepNotifier,
    cuda_driver_info,
    cuda_unavailable_reason,
)

#: The completion mechanisms StepNotifier accepts; the first is the default.
MECHANISMS = ("stream_callback", "event_thread")


def is_available() -> bool:
    """Whether the CUDA driver loads and initialises (a GPU is present). Never raises."""
    return cuda_unavailable_reason() is None


def unavailable_reason():
    """None when CUDA is usable, else a sentence saying why not and what to do."""
    return cuda_unavailable_reason()


def driver_info() -> dict:
    """``{"path": ..., "version": ...}`` of the loaded driver; raises CudaUnavailableError without one."""
    return cuda_driver_info()


__all__ = [
    "MECHANISMS",
    "CudaError",
    "CudaUnavailableError",
    "StepNotifier",
    "driver_info",
    "is_available",
    "unavailable_reason",
]
