"""HostStepNotifier from Python: a worker thread completes steps; the engine loop waits on them with its inputs."""

import threading
import time

import pytest

import hotloop
from hotloop import HostStepNotifier, InputQueue, WaitPolicy, wait_any

PARK_AT_ONCE = WaitPolicy(spin_us=0, yield_us=0)


def test_done_before_and_after_completion_and_ordering():
    n = HostStepNotifier()
    a, b = n.mark(), n.mark()
    assert b == a + 1
    assert not n.done(a) and not n.done(b)
    n.complete(b)  # completing a later step implies the earlier ones
    assert n.done(a) and n.done(b)
    assert (n.issued, n.completed) == (2, 2)


def test_wait_wakes_when_the_worker_completes_and_times_out_otherwise():
    n = HostStepNotifier()
    t = n.mark()
    assert n.wait(t, timeout=0.02) is False
    worker = threading.Timer(0.05, lambda: n.complete(t))
    worker.start()
    t0 = time.monotonic()
    assert n.wait(t, timeout=5, policy=PARK_AT_ONCE) is True
    assert time.monotonic() - t0 < 2
    worker.join()


def test_wait_any_over_inputs_and_a_step_returns_whichever_fires_first():
    n, q = HostStepNotifier(), InputQueue()
    step = n.until(n.mark())
    t = threading.Timer(0.05, lambda: q.put("request"))
    t.start()
    assert wait_any([step, q], timeout=5, policy=PARK_AT_ONCE) == [q]
    t.join()
    q.get_nowait()
    t = threading.Timer(0.05, lambda: n.complete(step.token))
    t.start()
    assert wait_any([step, q], timeout=5, policy=PARK_AT_ONCE) == [step]
    t.join()


def test_failed_step_raises_with_the_reason():
    n = HostStepNotifier()
    a, b, c = n.mark(), n.mark(), n.mark()
    n.complete(a)
    n.fail(b, "worker raised ValueError: bad input")
    assert n.done(a)
    with pytest.raises(hotloop.StepError, match="step 2 failed: worker raised ValueError"):
        n.done(b)
    n.complete(c)
    with pytest.raises(hotloop.StepError):
        n.wait(c, timeout=1)


def test_bad_tokens_give_clear_errors():
    n = HostStepNotifier()
    with pytest.raises(ValueError, match="not issued by this notifier"):
        n.done(0)
    first = n.mark()
    with pytest.raises(ValueError, match="has issued only 1"):
        n.done(first + 4)  # a token in the future
    other = HostStepNotifier()
    foreign = other.mark()
    other.complete(foreign)
    with pytest.raises(ValueError, match="not issued by this notifier"):
        n.until(foreign)
    with pytest.raises(ValueError, match="not issued by this notifier"):
        n.done(foreign)
    with pytest.raises(TypeError):
        n.done(-1)
