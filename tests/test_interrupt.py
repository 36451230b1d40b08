"""Ctrl-C (SIGINT) interrupts a wait that has no timeout, on the main thread: within ~100 ms when the main thread
receives it, within a slice (500 ms) when another thread of the process caught it."""

import signal
import subprocess
import sys
import time

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
