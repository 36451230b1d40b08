"""Ctrl-C (SIGINT) interrupts a wait that has no timeout, on the main thread: within ~100 ms when the main thread
receives it, within a slice (500 ms) when another thread of the process caught it."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import process_sleeping, wait_until

CHILD = r"""
import signal, sys, threading, time, hotloop
kind, caught_by = sys.argv[1], sys.argv[2]
policy = hotloop.WaitPolicy(spin_us=0, yield_us=0)
if kind == "queue read":  # a shared-memory queue reader: its park also ends every 500 ms for the writer's liveness
    writer = hotloop.MessageQueue(1, 1, policy=policy)
    reader = hotloop.MessageQueue.create_from_handle(writer.export_handle(), 0, policy=policy)
    writer.wait_until_ready(10)
    wait = reader.dequeue
else:
    sources = {"flag": [hotloop.Flag()], "queue": [hotloop.InputQueue()], "socket": None}[kind]
    if sources is None:
        import socket
        a, b = socket.socketpair()
        sources = [a]
    wait = lambda: hotloop.wait_any(sources, policy=policy)
if caught_by == "another thread":  # the kernel gives it to a thread that is not parked: the main thread's park is
    def catch():                   # not interrupted; only its slice notices the pending signal
        time.sleep(0.5)
        print("sent", time.monotonic(), flush=True)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        time.sleep(60)
    threading.Thread(target=catch, daemon=True).start()
print("waiting", flush=True)
try:
    wait()
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
    sys.exit(3)
print("returned", flush=True)
"""


@pytest.mark.parametrize("kind", ["flag", "queue", "socket", "queue read"])
def test_sigint_interrupts_a_wait_without_timeout(kind):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, "main thread"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        wait_until(lambda: process_sleeping(proc.pid), what="the child parking")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == 3, f"child did not raise KeyboardInterrupt: rc={proc.returncode} out={out!r}"
    word, when = out.split()
    assert word == "interrupted"
    assert float(when) - sent < 0.5, f"took {float(when) - sent:.3f} s to react to Ctrl-C"


@pytest.mark.parametrize("kind", ["flag", "queue read"])
def test_a_sigint_caught_by_another_thread_ends_the_main_threads_wait_within_a_slice(kind):
    proc = subprocess.run([sys.executable, "-c", CHILD, kind, "another thread"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 3, f"child did not raise KeyboardInterrupt: rc={proc.returncode} {proc.stdout!r}"
    lines = dict(line.split() for line in proc.stdout.splitlines() if line != "waiting")
    took = float(lines["interrupted"]) - float(lines["sent"])
    assert took < 1.5, f"the main thread noticed the signal {took:.2f} s later (slice: 500 ms)"


HELPER_START_CHILD = r"""
import socket, sys, time, hotloop
from hotloop import _core
backend = _core.set_park_backend("fallback")["backend"]
a, b = socket.socketpair()
print("waiting", backend.replace(" ", "_"), flush=True)
try:
    hotloop.wait_any([hotloop.Flag(), a], policy=hotloop.WaitPolicy(spin_us=0, yield_us=0))
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
    sys.exit(3)
"""
# Shorter than a signal slice: a park that slept through the signal would end at its slice's end, after the start-up.
HELPER_START_DELAY_S = 0.05


def _interrupt_during_helper_start(shim):
    """Runs HELPER_START_CHILD with the helper's start held back, sends SIGINT during the start-up; returns (the
    time it was sent, the helper's start, the KeyboardInterrupt), or None when the helper started first."""
    env = dict(os.environ, LD_PRELOAD=str(shim),
               HOTLOOP_TEST_THREAD_START_DELAY_MS=str(int(HELPER_START_DELAY_S * 1e3)))
    proc = subprocess.Popen([sys.executable, "-c", HELPER_START_CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        word, backend = proc.stdout.readline().split()
        assert word == "waiting"
        if backend != "futex_waitv_helper":
            pytest.skip(f"the futex_waitv helper backend is not available here (got {backend})")
        # The helper's thread exists (held in the shim) and the main thread sleeps: the park's start-up.
        wait_until(lambda: len(os.listdir(f"/proc/{proc.pid}/task")) == 2 and process_sleeping(proc.pid),
                   what="the child starting its helper")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 3, f"child did not raise KeyboardInterrupt: rc={proc.returncode} {out!r} {err!r}"
    started = float(next(line for line in err.splitlines() if line.startswith("thread-started")).split()[1])
    return (sent, started, float(out.split()[1])) if sent < started else None


def test_ctrl_c_while_the_futex_waitv_helper_starts_ends_the_mixed_wait_once_it_runs(tmp_path):
    """A thread's first mixed park on the futex_waitv helper backend starts the thread's helper and sleeps until it
    runs. A Ctrl-C in that sleep ends the park as soon as the helper runs, not at the end of the signal slice. A
    preloaded shim (tests/shims/delay_thread_start.c) holds the helper's start back 50 ms, so that the signal
    lands there, and reports when the helper started."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.fail("this test builds a preloaded shim: install a C compiler (apt-get install gcc)")
    shim = tmp_path / "delay_thread_start.so"
    src = Path(__file__).parent / "shims" / "delay_thread_start.c"
    build = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(src), "-ldl"], capture_output=True,
                           text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    for _ in range(5):  # the signal must land in the 50 ms start-up: on a loaded machine the first try may miss it
        got = _interrupt_during_helper_start(shim)
        if got is not None:
            break
    else:
        pytest.fail("five tries sent the signal only after the helper had started")
    sent, started, interrupted = got
    assert interrupted - started < 0.1, (
        f"the wait ended {interrupted - started:.3f} s after the helper started: the signal (sent during its "
        "start-up) was noticed only at the end of a slice")


def test_a_daemon_thread_still_waiting_at_exit_does_not_abort_the_process():
    code = (
        "import threading, hotloop\n"
        "f = hotloop.Flag()\n"
        "threading.Thread(target=lambda: hotloop.wait_any([f], timeout=0.2), daemon=True).start()\n"
        "print('bye')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "bye" and "terminate" not in out.stderr
