"""wait_any / Waiter / Flag / FdSource from Python: readiness, timeouts, wake-ups, the GIL, bad input."""

import os
import socket
import threading
import time

import pytest

import hotloop
from hotloop import FdSource, Flag, InputQueue, WaitPolicy, Waiter, wait_any

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


@pytest.mark.parametrize("policy", [PARK_AT_ONCE, WaitPolicy(), WaitPolicy(spin_us=50_000), WaitPolicy(adaptive=True)])
def test_timeout_is_honoured(policy):
    t0 = time.monotonic()
    assert wait_any([Flag()], timeout=0.05, policy=policy) == []
    waited = time.monotonic() - t0
    assert 0.05 <= waited < 0.05 + 0.1


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
        assert woke - set_at[0] < 0.05, "woken by the flag's eventfd, not by the 100 ms descriptor recheck"


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
        time.sleep(0.05)
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


def test_many_waiters_on_one_flag_all_wake():
    f = Flag()
    results = []

    def waiter():
        results.append(wait_any([f], timeout=5, policy=PARK_AT_ONCE))

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)
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
