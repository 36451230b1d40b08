"""Shared fixtures: every test must leave no threads and no file descriptors behind."""

import os
import threading
import time

import pytest

# multiprocessing's resource tracker (started by the first spawned process and kept for the whole session) holds
# a pipe; start it now so it is not counted as a leak of whichever test spawns first.
from multiprocessing import resource_tracker  # noqa: E402

resource_tracker.ensure_running()


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_leaks():
    threads_before = set(threading.enumerate())
    fds_before = _open_fds()
    yield
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        extra_threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        extra_fds = _open_fds() - fds_before
        if not extra_threads and not extra_fds:
            return
        time.sleep(0.01)
    assert not extra_threads, f"test left threads running: {extra_threads}"
    # an fd listed before may have been closed; only new ones count as leaks
    leaked = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in extra_fds if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked, f"test left file descriptors open: {leaked}"


# CUDA: the process opens one driver, once. Unless HOTLOOP_TEST_CUDA=real (the GPU check script sets it), the
# suite runs against the fake driver shipped in hotloop.testing, selected here before any test can open one.
CUDA_BACKEND = os.environ.get("HOTLOOP_TEST_CUDA", "fake")
if CUDA_BACKEND == "fake":
    from hotloop.testing import FAKE_CUDA_LIBRARY

    os.environ["HOTLOOP_CUDA_DRIVER"] = FAKE_CUDA_LIBRARY
