"""Test helpers for engine code built on hotloop.

:class:`FakeCudaDriver` drives the fake CUDA driver shipped with hotloop (``libhotloop_fake_cuda.so``): streams
emulated by host threads, kernels that sleep, wait for a gate or fault. Select it with :func:`use_fake_cuda`
before anything in the process opens the CUDA driver; then :class:`hotloop.cuda.StepNotifier` runs on a
machine without a GPU.
"""

import ctypes
import os

import hotloop._core as _core

FAKE_CUDA_LIBRARY = os.path.join(os.path.dirname(_core.__file__), "testing", "libhotloop_fake_cuda.so")


class FakeCudaDriver:
    """The test controls of the fake driver (the same library instance hotloop opens)."""

    def __init__(self, path: str = FAKE_CUDA_LIBRARY):
        self.path = path
        lib = ctypes.CDLL(path)
        lib.fakecu_stream_create.restype = ctypes.c_void_p
        lib.fakecu_stream_destroy.argtypes = [ctypes.c_void_p]
        lib.fakecu_launch_sleep.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.fakecu_launch_gated.argtypes = [ctypes.c_void_p]
        lib.fakecu_launch_gated.restype = ctypes.c_uint64
        lib.fakecu_open_gate.argtypes = [ctypes.c_uint64]
        lib.fakecu_launch_fault.argtypes = [ctypes.c_void_p]
        lib.fakecu_events_alive.restype = ctypes.c_int64
        self._lib = lib

    def make_current(self) -> None:
        """Make the fake context current on the calling thread (what torch does when it initialises CUDA)."""
        self._lib.fakecu_make_current()

    def stream_create(self) -> int:
        """A new stream (its handle); it executes its work in order on a host thread."""
        return self._lib.fakecu_stream_create()

    def stream_destroy(self, stream: int) -> None:
        """Run what is enqueued on the stream, then destroy it."""
        self._lib.fakecu_stream_destroy(stream)

    def launch_sleep(self, stream: int, seconds: float) -> None:
        """Enqueue a kernel that runs for `seconds`."""
        self._check(self._lib.fakecu_launch_sleep(stream, int(seconds * 1e9)))

    def launch_gated(self, stream: int) -> int:
        """Enqueue a kernel that runs until open_gate(returned id)."""
        gate = self._lib.fakecu_launch_gated(stream)
        if gate == 0:
            raise ValueError(f"{stream} is not a stream of the fake driver")
        return gate

    def open_gate(self, gate: int) -> None:
        self._lib.fakecu_open_gate(gate)

    def launch_fault(self, stream: int) -> None:
        """Enqueue a kernel that faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky until reset_error)."""
        self._check(self._lib.fakecu_launch_fault(stream))

    def reset_error(self) -> None:
        self._lib.fakecu_reset_error()

    def events_alive(self) -> int:
        return self._lib.fakecu_events_alive()

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise ValueError(f"fake CUDA driver call failed with CUresult {rc}")


def use_fake_cuda() -> FakeCudaDriver:
    """Point hotloop at the fake driver (HOTLOOP_CUDA_DRIVER) and make its context current on this thread.

    Must run before the process first opens the CUDA driver; raises RuntimeError if another one is loaded.
    """
    os.environ["HOTLOOP_CUDA_DRIVER"] = FAKE_CUDA_LIBRARY
    fake = FakeCudaDriver()
    reason = _core.cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the fake CUDA driver did not load: {reason}")
    if os.path.realpath(_core.cuda_driver_info()["path"]) != os.path.realpath(FAKE_CUDA_LIBRARY):
        raise RuntimeError("another CUDA driver was loaded in this process before use_fake_cuda(): "
                           "call it before anything opens the driver (or run in a fresh process)")
    fake.make_current()
    return fake


__all__ = ["FAKE_CUDA_LIBRARY", "FakeCudaDriver", "use_fake_cuda"]
