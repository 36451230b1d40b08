"""Process lifecycle: die with the parent (kernel parent-death signal), stop children with escalation."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux prctl PR_SET_PDEATHSIG).

    If the parent is already gone (we were re-parented before this call), exit now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:
        os._exit(1)


def stop_processes(procs, grace_s: float = 5.0, term_s: float = 2.0) -> None:
    """Wait for processes to exit, then SIGTERM the rest, then SIGKILL; always reaps them."""
    import multiprocessing.connection as mpc
    import time

    def wait_all(seconds: float) -> list:
        deadline = time.monotonic() + seconds
        alive = [p for p in procs if p.exitcode is None]
        while alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            mpc.wait([p.sentinel for p in alive], timeout=left)
            alive = [p for p in alive if p.exitcode is None]
        return alive

    alive = wait_all(grace_s)
    for p in alive:
        p.terminate()
    alive = wait_all(term_s) if alive else []
    for p in alive:
        p.kill()
    for p in procs:
        p.join()
