"""The simulated device's clock (hotloop.testing.device_clock): a step lasts its modelled time and costs no CPU,
the TP ranks of a step end together at the last rank's start + the step's time, a rank that never starts is named,
and no segment is left behind. Torch-free; ranks are forked processes."""

import multiprocessing as mp
import os
import threading
import time
import uuid

import pytest

from hotloop.testing.device_clock import DeviceClock, parse_spec, segment_path

CTX = mp.get_context("fork")


def _name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def test_a_step_lasts_its_modelled_time_off_the_cpu():
    clock = DeviceClock(_name(), 0, 1, base_us=2000, per_token_us=100)
    try:
        for tokens in (0, 10, 30):
            cpu0 = time.thread_time_ns()
            start, end = clock.step(tokens)
            done, cpu = time.monotonic_ns(), time.thread_time_ns() - cpu0
            want = 2_000_000 + 100_000 * tokens
            assert end - start == want
            assert done >= end, "step() returned before the modelled end"
            assert done - end < 20_000_000, f"step() returned {(done - end) / 1e6:.1f} ms after its end"
            # asleep, not spinning: a spin would cost the whole step (2-5 ms) of CPU
            assert cpu < 0.3 * want, f"a {want / 1e6:.1f} ms step cost {cpu / 1e6:.2f} ms of CPU"
    finally:
        clock.close()
    assert not os.path.exists(segment_path(clock.name))


def _rank(name, rank, world, delays_ms, out):
    clock = DeviceClock(name, rank, world, base_us=3000, per_token_us=0)
    res = []
    for delay in delays_ms:
        time.sleep(delay / 1e3)  # this rank's host work before the step: some ranks start late
        cpu0 = time.thread_time_ns()
        start, end = clock.step(1)
        res.append((start, end, time.monotonic_ns(), time.thread_time_ns() - cpu0))
    clock.close()
    out.put((rank, res))


def _run_ranks(target, name, world, delays) -> dict:
    """Runs target(name, rank, world, delays[rank], out) in one forked process per rank: {rank: its results}."""
    out = CTX.Queue()
    procs = [CTX.Process(target=target, args=(name, r, world, delays[r], out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    out.close()
    out.join_thread()
    return results


def test_tp_ranks_end_each_step_together_at_the_last_start_plus_the_step_time():
    name, world = _name(), 3
    # per rank, the delay before each of 4 steps: a different rank starts last in each step
    delays = {0: [0, 10, 0, 0], 1: [0, 0, 15, 0], 2: [20, 0, 0, 0]}
    results = _run_ranks(_rank, name, world, delays)
    for step in range(4):
        rows = [results[r][step] for r in range(world)]
        last_start = max(r[0] for r in rows)
        for rank, (start, end, returned, cpu) in enumerate(rows):
            assert end == last_start + 3_000_000, f"step {step} rank {rank}: ends at its own clock, not the last start"
            assert returned >= end
            # asleep, not spinning: a spin would cost the whole wait (3-18 ms) of CPU
            waited = returned - start
            assert cpu < max(2_000_000, 0.5 * waited), \
                f"step {step} rank {rank}: {cpu / 1e6:.2f} ms of CPU in {waited / 1e6:.1f} ms waiting for its peers"
        if step < 3:  # one rank started 10-20 ms late: the others waited for it instead of ending early
            assert last_start - min(r[0] for r in rows) >= 5_000_000
    assert not os.path.exists(segment_path(name)), "rank 0 leaves the segment's name behind"


def test_a_rank_that_never_starts_is_named():
    name = _name()
    clock = DeviceClock(name, 0, 2, base_us=100, per_token_us=0, peer_timeout_s=0.2)
    try:
        with pytest.raises(RuntimeError, match="TP rank 1 did not start step 1"):
            clock.step(1)
    finally:
        clock.close()
    assert not os.path.exists(segment_path(name))


def test_bad_arguments_and_specs_say_what_is_wrong():
    with pytest.raises(ValueError, match="rank"):
        DeviceClock(_name(), 2, 2, 100, 0)
    with pytest.raises(ValueError, match=">= 0"):
        DeviceClock(_name(), 0, 1, -1, 0)
    assert parse_spec("1") == (1300.0, 2.0)
    assert parse_spec("500+1.5") == (500.0, 1.5)
    for bad in ("fast", "1+2+3", "-5+1"):
        with pytest.raises(ValueError, match="HOTLOOP_VLLM_SIM_DEVICE"):
            parse_spec(bad)


def test_a_launch_returns_at_once_and_steps_queue_behind_each_other_on_the_device():
    # vLLM's async path: forward returns once queued; the sampled tokens are waited for later, in another thread
    clock = DeviceClock(_name(), 0, 1, base_us=3000, per_token_us=100)
    try:
        t0 = time.monotonic_ns()
        k1 = clock.launch(10)  # 4 ms
        k2 = clock.launch(0)   # 3 ms, queued behind k1
        assert (k1, k2) == (1, 2) and clock.tail() == 2
        assert time.monotonic_ns() - t0 < 2_000_000, "a launch must not wait for the device"
        assert not clock.done(k1)
        got = {}

        def waiter():
            cpu0 = time.thread_time_ns()
            got["k2"] = clock.wait(k2)
            got["cpu"] = time.thread_time_ns() - cpu0
            got["returned"] = time.monotonic_ns()

        th = threading.Thread(target=waiter)
        th.start()
        launch1, end1 = clock.wait(k1)
        th.join(timeout=10)
        launch2, end2 = got["k2"]
        assert end1 == launch1 + 4_000_000
        assert end2 == end1 + 3_000_000, "step 2 starts on the device when step 1 is done, not at its launch"
        assert got["returned"] >= end2 and got["cpu"] < 2_000_000, "the wait sleeps until the end, off the CPU"
        assert clock.done(k1) and clock.done(k2)
        time.sleep(0.005)  # the device idles: the next step starts at its launch
        launch3, end3 = clock.step(0)
        assert end3 == launch3 + 3_000_000
        with pytest.raises(ValueError, match="never launched"):
            clock.wait(4)
    finally:
        clock.close()


def _async_rank(name, rank, world, delays_ms, out):
    clock = DeviceClock(name, rank, world, base_us=3000, per_token_us=0)
    launched = []
    for delay in delays_ms:  # two steps in flight, as vLLM's batch queue keeps them
        time.sleep(delay / 1e3)
        launched.append(clock.launch(1))
    out.put((rank, [clock.wait(k) for k in launched]))
    clock.close()


def test_tp_ranks_launching_ahead_end_each_step_together():
    name, world = _name(), 2
    delays = {0: [0, 0, 0, 0], 1: [10, 0, 12, 0]}  # rank 1 launches steps 1 and 3 late
    results = _run_ranks(_async_rank, name, world, delays)
    prev_end = 0
    for step in range(4):
        launches = [results[r][step][0] for r in range(world)]
        ends = {results[r][step][1] for r in range(world)}
        assert ends == {max(max(launches), prev_end) + 3_000_000}, f"step {step}: {ends}"
        prev_end = ends.pop()
    assert not os.path.exists(segment_path(name))
