"""wait_any / Waiter / Flag / FdSource from Python: readiness, timeouts, wake-ups, the GIL, bad input; the park
backends of waits over doorbells and descriptors together, forced in turn."""

import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import process_sleeping, wait_until

import hotloop
from hotloop import FdSource, Flag, InputQueue, MessageQueue, WaitPolicy, Waiter, _core, wait_any

PARK_AT_ONCE = WaitPolicy(spin_us=0, yield_us=0)


def later(seconds, fn):
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def test_returns_the_ready_sources_in_order_and_consumes_nothing():
    a, b, c = Flag(), Flag(), Flag()
    b.set()
    c.set()
    assert wait_any([a, b, c], timeout=0) == [b, c]
    assert wait_any([a, b, c], timeout=0) == [b, c]
    assert b.is_set() and c.is_set()
    q = InputQueue()
    q.put(1)
    assert wait_any([q], timeout=0) == [q]
    assert len(q) == 1


@pytest.mark.parametrize("policy", [PARK_AT_ONCE, WaitPolicy(), WaitPolicy(spin_us=50_000), WaitPolicy(adaptive=True),
                                    WaitPolicy(paced=True)])
def test_timeout_is_honoured(policy):
    t0 = time.monotonic()
    assert wait_any([Flag()], timeout=0.05, policy=policy) == []
    waited = time.monotonic() - t0
    assert 0.05 <= waited < 0.05 + 1.0  # never early; late only by scheduling (a 2-core machine under load: 0.17 s)


def test_flag_set_from_another_thread_wakes_a_parked_wait():
    f = Flag()
    t = later(0.05, f.set)
    w = Waiter([f], policy=PARK_AT_ONCE)
    t0 = time.monotonic()
    assert w.wait(timeout=5) == [f]
    assert time.monotonic() - t0 < 2
    assert w.last_phase == "park"
    t.join()


def test_input_queue_put_wakes_a_parked_wait():
    q, f = InputQueue(), Flag()
    t = later(0.05, lambda: q.put("request"))
    assert wait_any([f, q], timeout=5, policy=PARK_AT_ONCE) == [q]
    assert q.get_nowait() == "request"
    t.join()


def test_socket_becoming_readable_wakes_a_parked_wait():
    a, b = socket.socketpair()
    with a, b:
        f = Flag()
        t = later(0.05, lambda: b.send(b"x"))
        ready = wait_any([f, a], timeout=5, policy=PARK_AT_ONCE)
        assert ready == [a], "the socket object itself is returned"
        t.join()
        # an int descriptor and an explicit FdSource work the same way
        assert wait_any([a.fileno()], timeout=0) == [a.fileno()]
        src = FdSource(a)
        assert src.fd == a.fileno() and src.ready()
        assert a.recv(1) == b"x"
        assert wait_any([src], timeout=0) == []


def test_flag_wakes_a_wait_that_also_watches_a_socket():
    a, b = socket.socketpair()
    with a, b:
        f = Flag()
        set_at = []
        t = later(0.03, lambda: (set_at.append(time.monotonic()), f.set()))
        assert wait_any([a, f], timeout=5, policy=PARK_AT_ONCE) == [f]
        woke = time.monotonic()
        t.join()
        assert woke - set_at[0] < 0.05, "woken by the flag at once, not by a periodic re-check"


def test_descriptor_closed_while_waited_on_raises():
    r, w = os.pipe()
    os.close(w)
    r2, w2 = os.pipe()
    try:
        src = FdSource(r2)
        t = later(0.05, lambda: os.close(r2))
        t0 = time.monotonic()
        with pytest.raises(hotloop.SourceError, match="closed while waited on"):
            wait_any([src], timeout=5, policy=PARK_AT_ONCE)
        assert time.monotonic() - t0 < 1
        t.join()
    finally:
        os.close(w2)
        os.close(r)


def test_gil_is_released_while_waiting():
    counter = 0
    stop = False

    def count():
        nonlocal counter
        while not stop:
            counter += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        wait_until(lambda: counter > 0, what="the counting thread running")
        before = counter
        # spin for the whole wait: even then, the other thread must run Python code throughout
        wait_any([Flag()], timeout=0.3, policy=WaitPolicy(spin_us=1_000_000))
        progressed = counter - before
    finally:
        stop = True
        t.join()
    assert progressed > 10_000, f"the counting thread made only {progressed} steps during a 0.3 s wait"


def test_bad_input_gives_clear_errors():
    f = Flag()
    with pytest.raises(ValueError, match="timeout"):
        wait_any([f], timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        wait_any([f], timeout=float("nan"))
    with pytest.raises(TypeError, match="timeout"):
        wait_any([f], timeout="soon")
    with pytest.raises(TypeError, match="cannot wait on an object of type"):
        wait_any([f, object()], timeout=0)
    with pytest.raises(TypeError, match="list or tuple"):
        wait_any("abc", timeout=0)
    with pytest.raises(ValueError, match="no sources and no timeout"):
        wait_any([])
    with pytest.raises(ValueError, match="at most 64"):
        wait_any([Flag() for _ in range(65)], timeout=0)
    with pytest.raises(ValueError, match=">= 0"):
        FdSource(-1)
    with pytest.raises(hotloop.SourceError, match="not open"):
        FdSource(999_999)
    with pytest.raises(ValueError, match="spin_us"):
        WaitPolicy(spin_us=-1)
    with pytest.raises(TypeError):
        FdSource("not a file")


def test_empty_wait_with_timeout_just_sleeps():
    t0 = time.monotonic()
    assert wait_any([], timeout=0.02) == []
    assert time.monotonic() - t0 >= 0.02


def test_wait_policy_fields_and_adaptive_learning():
    p = WaitPolicy(spin_us=30, yield_us=5, adaptive=True)
    assert (p.spin_us, p.yield_us, p.adaptive) == (30, 5, True)
    assert p.recent_wait_us is None
    f = Flag()
    w = Waiter([f], policy=p)
    assert w.policy is not p, "a Waiter keeps its own copy of the policy"
    for _ in range(10):
        t = later(0.004, f.set)
        assert w.wait(timeout=5) == [f]
        f.clear()
        t.join()
    assert w.policy.recent_wait_us > 30
    assert w.policy.budgets_us() == (w.policy.min_spin_us, 0.0), "events 4 ms apart: park almost at once"


def test_paced_policy_surface():
    p = WaitPolicy(paced=True)
    assert p.paced and not WaitPolicy().paced and "paced=True" in repr(p)
    assert (p.spin_us, p.yield_us, p.adaptive) == (20.0, 10.0, False), "the other defaults are unchanged"
    assert p.lead_us == 20.0 and WaitPolicy(paced=True, lead_us=50).lead_us == 50.0
    assert p.anchor_ns is None and p.interval_us is None and not p.predicting
    assert p.paced_stats() == {"predicted": 0, "hit": 0, "early": 0, "late": 0, "samples": 0, "misses": 0,
                               "interval_us": -1.0, "deviation_us": 0.0, "timer_late_us": 30.0}
    before = time.monotonic_ns()
    p.anchor()
    assert before <= p.anchor_ns <= time.monotonic_ns()
    p.anchor(12345)
    assert p.anchor_ns == 12345
    p.paced = False
    assert not p.paced
    with pytest.raises(ValueError):
        WaitPolicy(paced=True, lead_us=-1)


def _train(waiter, flag, period_s, n):
    """n readies `period_s` apart, on a schedule kept by a thread (late ticks do not push the later ones)."""
    rang = [0]

    def ring():
        t = time.monotonic()
        for _ in range(n):
            t += period_s
            time.sleep(max(0.0, t - time.monotonic()))
            rang[0] += 1
            flag.set()

    ringer = threading.Thread(target=ring)
    ringer.start()
    got = 0
    while got < n:
        assert waiter.wait(timeout=5) == [flag], f"a ring was lost ({got} of {n} seen, {rang[0]} rung)"
        flag.clear()
        # a flag is a level: rings that came while a loaded machine kept the waiter late are one ready flag
        got = rang[0]
    ringer.join()


def test_paced_waiter_learns_a_steady_period_and_predicts():
    f = Flag()
    w = Waiter([f], policy=WaitPolicy(paced=True))
    _train(w, f, 0.004, 60)
    st = w.policy.paced_stats()
    assert st["samples"] >= 10 and st["predicted"] >= 10, st
    assert 2_000 < w.policy.interval_us < 8_000, st
    assert st["hit"] + st["early"] + st["late"] == st["predicted"], "no predicted wait timed out"


def test_paced_wait_is_woken_early_by_a_ring_during_its_timed_park():
    f = Flag()
    w = Waiter([f], policy=WaitPolicy(paced=True))
    _train(w, f, 0.05, 8)  # the next ready is predicted ~50 ms after the last
    assert w.policy.predicting
    early = w.policy.paced_stats()["early"]
    w.policy.anchor(time.monotonic_ns() + 10_000_000_000)  # predicted 10 s from now: the wait parks on a timer
    result = []
    t = threading.Thread(target=lambda: result.append(w.wait(timeout=30)))
    t0 = time.monotonic()
    t.start()
    wait_until(lambda: f.parked == 1, what="the paced wait parking")
    f.set()
    t.join()
    assert result == [[f]] and time.monotonic() - t0 < 5
    assert w.policy.paced_stats()["early"] == early + 1


def test_many_waiters_on_one_flag_all_wake():
    f = Flag()
    results = []

    def waiter():
        results.append(wait_any([f], timeout=5, policy=PARK_AT_ONCE))

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: f.parked == 8, what="eight waiters parking")
    f.set()
    for t in threads:
        t.join()
    assert results == [[f]] * 8


def test_prompt_gil_handover_restores_the_switch_interval():
    import sys

    before = sys.getswitchinterval()
    flags = [Flag() for _ in range(4)]
    results = []

    def waiter(f):
        for _ in range(50):
            results.append(wait_any([f], timeout=5, prompt_gil=True))
            f.clear()

    threads = [threading.Thread(target=waiter, args=(f,)) for f in flags]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        for f in flags:
            f.set()
    for t in threads:
        t.join()
    assert len(results) == 200 and all(results)
    assert sys.getswitchinterval() == before, "concurrent prompt hand-overs must leave the interval as it was"


# quiet: beside three test suites at once its median was 5.4 ms (the busy thread and the waiter need a core each)
@pytest.mark.quiet
def test_a_woken_waiter_gets_the_gil_back_promptly_beside_a_busy_python_thread():
    """The hand-over works on this Python (3.10-3.11 shorten the switch interval at wake-up, 3.12+ before
    parking): a thread running pure Python would otherwise keep the woken waiter out for its whole switch
    interval (5 ms). The flag is set from a C++ thread (no GIL), every 3 ms; the lag is set -> back in Python."""
    import sys

    from hotloop._core import bench as core_bench

    before = sys.getswitchinterval()
    stop, f, lags = [False], Flag(), []

    def busy():
        n = 0
        while not stop[0]:
            n += 1

    t = threading.Thread(target=busy)
    t.start()
    try:
        with core_bench.Ticker(f, 0.003) as ticker:
            while len(lags) < 60:
                assert wait_any([f], timeout=5, prompt_gil=True) == [f]
                lags.append(time.monotonic_ns() - ticker.last_set_ns)
                f.clear()
        assert wait_any([f], timeout=0.001, prompt_gil=True) == []  # the interval comes back after a timeout
        with pytest.raises(TypeError):
            wait_any([object()], timeout=1, prompt_gil=True)  # ... and an error
    finally:
        stop[0] = True
        t.join()
    assert sys.getswitchinterval() == before
    lag_ms = statistics.median(lags) / 1e6
    # Without the hand-over every lag is at least the 5 ms interval (the waiter asks for the GIL only after waiting
    # it out); with it the median is ~0.2 ms on a quiet machine (hotloop bench wait (b)), and 2.02 ms was seen on
    # Python 3.13 with both cores taken by other work: the bound sits between the two.
    assert lag_ms < 3.5, f"median set -> back in Python {lag_ms:.2f} ms: the waiter waited out the switch interval"


# ---- one park for doorbells and descriptors together (io_uring, futex_waitv helper) ------------------------------

FORK = mp.get_context("fork")
BACKENDS = {"uring": "io_uring", "fallback": "futex_waitv helper"}


@pytest.fixture(scope="module", autouse=True)
def _park_resources_of_this_thread():
    """Each backend keeps per-thread resources (a ring; a helper thread and an eventfd; an epoll watch) for the thread's life:
    set them up before the per-test leak check takes its snapshot."""
    for name in BACKENDS:
        _core.set_park_backend(name)
        _core.prepare_park()
    _core.set_park_backend("auto")
    yield
    _core.set_park_backend("auto")


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    chosen = _core.set_park_backend(request.param)
    if chosen["backend"] != BACKENDS[request.param]:
        _core.set_park_backend("auto")
        pytest.skip(f"{request.param} is not available here: {chosen['reason']}")
    yield chosen["backend"]
    _core.set_park_backend("auto")


def _echo_after(go_r, go_w, writer, rounds, delay):
    """Child: for each byte on go_r, wait `delay`, then enqueue the time (CLOCK_MONOTONIC ns) through `writer`. Its
    forked copy of the pipe's write end is closed first, so the parent's close ends it."""
    os.close(go_w)
    for _ in range(rounds):
        if not os.read(go_r, 1):
            break
        time.sleep(delay)
        writer.enqueue_bytes(struct.pack("q", time.monotonic_ns()))
    os._exit(0)


def test_park_backend_is_reported_and_selectable():
    info = _core.park_backend()
    assert info["backend"] in ("io_uring", "futex_waitv helper", "sliced")
    sliced = _core.set_park_backend("sliced")
    assert sliced == {"backend": "sliced", "reason": "requested by set_park_backend('sliced')"}
    assert _core.set_park_backend("auto")["backend"] != "sliced", "this machine has futex_waitv (Linux >= 5.16)"
    with pytest.raises(ValueError, match="unknown park backend"):
        _core.set_park_backend("bogus")
    from hotloop.cli import info as cli_info

    assert cli_info()["park_backend"].startswith(_core.park_backend()["backend"])


@pytest.mark.parametrize("value, expected", [("fallback", "futex_waitv helper"), ("sliced", "sliced"),
                                             ("bogus", None)])
def test_park_backend_follows_the_environment(value, expected):
    code = "import json, hotloop._core as c; print(json.dumps(c.park_backend()))"
    env = dict(os.environ, HOTLOOP_PARK=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if expected is None:
        assert "HOTLOOP_PARK='bogus'" in got["reason"]
    else:
        assert got["backend"] == expected and "HOTLOOP_PARK" in got["reason"]


def test_shared_memory_reader_rung_by_another_process_wakes_a_wait_that_also_watches_a_socket(backend):
    """The ring from the other process reaches the park at once: no 100 ms re-check."""
    rounds = 12
    q = MessageQueue(1)
    go_r, go_w = os.pipe()
    child = FORK.Process(target=_echo_after, args=(go_r, go_w, q, rounds, 0.01))
    child.start()
    reader = MessageQueue.create_from_handle(q.export_handle(), 0)
    a, b = socket.socketpair()
    try:
        q.wait_until_ready(30)
        w = Waiter([reader, a], policy=PARK_AT_ONCE)
        lat, phases = [], []
        for i in range(rounds):
            os.write(go_w, b"g")
            assert w.wait(timeout=5) == [reader], f"round {i}"
            woke = w.last_wake_ns
            (sent,) = struct.unpack("q", reader.dequeue_bytes(timeout=1))
            phases.append(w.last_phase)
            if w.last_phase == "park":
                lat.append(woke - sent)
        # a round whose message came before the wait parked (the child's 10 ms delay outlasted by a loaded
        # machine's scheduling) ends "immediate" and says nothing of the wake-up: most rounds park
        assert phases.count("park") >= rounds // 2 and set(phases) <= {"park", "immediate"}, phases
        assert w.safety_wakeups == 0
    finally:
        os.close(go_w)
        child.join(10)
        if child.is_alive():  # a failed round left it waiting for its next byte
            child.kill()
            child.join()
        os.close(go_r)
        a.close()
        b.close()
        reader.close()
        q.close()
    assert child.exitcode == 0
    # the median over rounds: a loaded machine may delay any one wake-up; a 100 ms re-check would put it near 100 ms
    assert statistics.median(lat) < 20e6, f"wake latencies (ms): {[round(x / 1e6, 2) for x in lat]}"


def test_socket_wakes_a_wait_that_also_watches_a_shared_memory_reader(backend):
    q = MessageQueue(1)
    reader = MessageQueue.create_from_handle(q.export_handle(), 0)
    a, b = socket.socketpair()
    try:
        lat = []
        for _ in range(5):
            sent = []
            t = later(0.01, lambda: (sent.append(time.monotonic_ns()), b.send(b"x")))
            assert wait_any([reader, a], timeout=5, policy=PARK_AT_ONCE) == [a]
            lat.append(time.monotonic_ns() - sent[0])
            t.join()
            assert a.recv(1) == b"x"
        assert statistics.median(lat) < 20e6, f"wake latencies (ms): {[round(x / 1e6, 2) for x in lat]}"
    finally:
        a.close()
        b.close()
        reader.close()
        q.close()


def _ping_pong_child(ping_writer, pong_handle, pipe_w, rounds):
    """Child: sends `rounds` pings (every third one as a pipe byte instead of a message), waiting for each pong."""
    pong = MessageQueue.create_from_handle(pong_handle, 0)
    ok = True
    for i in range(rounds):
        if i % 3 == 2:
            os.write(pipe_w, b"x")
        else:
            ping_writer.enqueue_bytes(b"p", timeout=5)
        try:
            pong.dequeue_bytes(timeout=5)
        except TimeoutError:
            ok = False
            break
    pong.close()
    os._exit(0 if ok else 4)


def test_no_lost_wake_up_in_a_cross_process_ping_pong_with_a_descriptor(backend):
    rounds = 600
    ping, pong = MessageQueue(1), MessageQueue(1)
    pipe_r, pipe_w = os.pipe()
    child = FORK.Process(target=_ping_pong_child, args=(ping, pong.export_handle(), pipe_w, rounds))
    child.start()
    reader = MessageQueue.create_from_handle(ping.export_handle(), 0)
    try:
        ping.wait_until_ready(30)
        pong.wait_until_ready(30)
        w = Waiter([reader, pipe_r], policy=WaitPolicy(spin_us=2, yield_us=0))
        for i in range(rounds):
            ready = w.wait(timeout=5)
            assert ready, f"round {i}: a wake-up was lost"
            if reader in ready:
                assert reader.dequeue_bytes(timeout=1) == b"p"
            else:
                assert os.read(pipe_r, 1) == b"x"
            pong.enqueue_bytes(b"q", timeout=5)
        assert w.safety_wakeups == 0
    finally:
        child.join(30)
        if child.exitcode is None:
            child.kill()
            child.join()
        os.close(pipe_r)
        os.close(pipe_w)
        reader.close()
        ping.close()
        pong.close()
    assert child.exitcode == 0


def test_descriptor_closed_while_a_mixed_wait_watches_it_raises(backend):
    r, w = os.pipe()
    try:
        src, f = FdSource(r), Flag()
        t = later(0.05, lambda: os.close(r))
        t0 = time.monotonic()
        with pytest.raises(hotloop.SourceError, match="closed while waited on"):
            wait_any([f, src], timeout=5, policy=PARK_AT_ONCE)  # main thread: re-validated every 500 ms slice
        assert time.monotonic() - t0 < 1
        t.join()
    finally:
        os.close(w)


INTERRUPTED_CHILD = r"""
import socket, sys, time, hotloop
from hotloop import _core
_core.set_park_backend(sys.argv[1])
a, b = socket.socketpair()
print("waiting", _core.park_backend()["backend"], flush=True)
try:
    hotloop.wait_any([hotloop.Flag(), a], policy=hotloop.WaitPolicy(spin_us=0, yield_us=0))
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
    sys.exit(3)
"""


def test_ctrl_c_interrupts_a_mixed_wait(backend):
    import signal

    request = {v: k for k, v in BACKENDS.items()}[backend]
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CHILD, request], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["waiting", *backend.split()]
        wait_until(lambda: process_sleeping(proc.pid), what="the child parking")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == 3, out
    assert float(out.split()[1]) - sent < 0.5
