"""Ctrl-C (SIGINT) interrupts a wait that has no timeout, on the main thread, within ~100 ms."""

import signal
import subprocess
import sys
import time

import pytest
from conftest import process_sleeping, wait_until

CHILD = r"""
import sys, time, hotloop
sources = {"flag": [hotloop.Flag()], "queue": [hotloop.InputQueue()], "socket": None}[sys.argv[1]]
if sources is None:
    import socket
    a, b = socket.socketpair()
    sources = [a]
policy = hotloop.WaitPolicy(spin_us=0, yield_us=0)
print("waiting", flush=True)
try:
    hotloop.wait_any(sources, policy=policy)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
    sys.exit(3)
print("returned", flush=True)
"""


@pytest.mark.parametrize("kind", ["flag", "queue", "socket"])
def test_sigint_interrupts_a_wait_without_timeout(kind):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, text=True)
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
