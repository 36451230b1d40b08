"""hotloop.vllm.MessageQueue with vLLM's calls, without vLLM's engine (and without vLLM installed): broadcast to
reader processes, large tensors, timeouts, indefinite waits, shutdown waking a parked reader, a reader that
raises mid-read, remote readers by vLLM rank, dead peers, handle mix-ups, and the plugin's gating."""

import logging
import multiprocessing as mp
import os
import re
import threading
import time

import pytest
from conftest import require_torch, wait_until

torch = require_torch()  # vLLM's messages carry tensors; vLLM itself is not needed

from hotloop import BadHandleError, ClosedError, DeadPeerError, wait_any  # noqa: E402
from hotloop.vllm import message_queue as vmq  # noqa: E402
from hotloop.vllm import MessageQueue  # noqa: E402

CTX = mp.get_context("fork")


def _segments():
    """This process's queue segments (hotloop-<pid namespace>-<writer pid>-...): other suites may run alongside."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("hotloop-") and f.split("-")[2:3] == [str(os.getpid())]}


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    before = _segments()
    yield
    deadline = time.monotonic() + 2
    while _segments() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _segments() - before == set(), "a test left a segment in /dev/shm"


def _step(i):
    """A message shaped like vLLM's collective_rpc: (method, args, kwargs, output_rank)."""
    return ("execute_model", ({"step": i, "ids": torch.arange(i % 50, dtype=torch.int64)},), {}, 0)


def _worker(handle, rank, count, results):
    try:
        q = MessageQueue.create_from_handle(handle, rank)
        q.wait_until_ready()
        total = 0
        for i in range(count):
            method, args, kwargs, out_rank = q.dequeue(indefinite=True)
            assert method == "execute_model" and args[0]["step"] == i, (rank, i, args[0]["step"])
            total += int(args[0]["ids"].sum())
        results.put((rank, total))
        q.close()
    except BaseException as e:  # report instead of hanging the writer
        results.put((rank, f"error: {e!r}"))


def test_broadcast_to_reader_processes_in_vllm_rank_order():
    count = 2000
    q = MessageQueue(3, 3, max_chunk_bytes=16 * 1024 * 1024, connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    handle = q.export_handle()
    assert handle.local_reader_ranks == [0, 1, 2] and handle.remote_subscribe_addr is None
    results = CTX.Queue()
    procs = [CTX.Process(target=_worker, args=(handle, r, count, results)) for r in range(3)]
    for p in procs:
        p.start()
    q.wait_until_ready()
    for i in range(count):
        q.enqueue(_step(i))
    expected = sum(sum(range(i % 50)) for i in range(count))
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    q.shutdown()
    q.close()
    assert got == {0: expected, 1: expected, 2: expected}


def _big_reader(handle, rank, results):
    q = MessageQueue.create_from_handle(handle, rank)
    for _ in range(2):
        obj = q.dequeue(timeout=60)
        t = obj["t"]
        t.add_(1)  # a tensor the reader owns: writable, not ring memory
        results.put((obj["name"], tuple(t.shape), t.dtype == torch.bfloat16, float(t.float().sum())))
    q.close()


def test_large_tensors_larger_than_the_ring_arrive_whole():
    q = MessageQueue(1, 1, max_chunk_bytes=1 << 20)  # a 4 MiB ring
    spawn = mp.get_context("spawn")  # the reader runs large torch ops: a forked child of a process whose torch
    results = spawn.Queue()          # thread pool already ran can hang in it
    p = spawn.Process(target=_big_reader, args=(q.export_handle(), 0, results))
    p.start()
    q.wait_until_ready()
    big = torch.zeros(6 * 1024 * 1024, dtype=torch.float32)  # 24 MiB: six times the ring
    q.enqueue({"name": "big", "t": big})
    q.enqueue({"name": "bf16", "t": torch.zeros(3, 1000, dtype=torch.bfloat16)})
    assert results.get(timeout=60) == ("big", (6 * 1024 * 1024,), False, float(6 * 1024 * 1024))
    assert results.get(timeout=60) == ("bf16", (3, 1000), True, 3000.0)
    p.join(30)
    q.close()


def test_timeouts_raise_timeout_error_and_full_ring_too():
    q = MessageQueue(1, 1, max_chunk_bytes=4096)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.05)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        with r.acquire_read(timeout=0.05):
            pass
    with pytest.raises(TimeoutError):  # nobody reads: the ring fills, enqueue gives up after its timeout
        for i in range(10_000):
            q.enqueue(b"x" * 3000, timeout=0.05)
    r.close()
    q.close()


def _indefinite_reader(handle, results):
    q = MessageQueue.create_from_handle(handle, 0)
    c0, t0 = time.process_time(), time.monotonic()
    obj = q.dequeue(indefinite=True)
    results.put((obj, time.monotonic() - t0, time.process_time() - c0))
    q.close()


def test_indefinite_dequeue_waits_parked_until_a_message_comes():
    q = MessageQueue(1, 1)
    results = CTX.Queue()
    p = CTX.Process(target=_indefinite_reader, args=(q.export_handle(), results))
    p.start()
    q.wait_until_ready(timeout=30)
    time.sleep(1.0)  # the reader waits this long
    q.enqueue("late")
    obj, waited, cpu = results.get(timeout=30)
    p.join(30)
    q.close()
    assert obj == "late" and waited >= 0.9
    assert cpu < 0.2, f"a parked reader used {cpu:.3f} s of CPU over {waited:.1f} s"


def test_shutdown_from_another_thread_wakes_a_parked_reader_like_vllms_death_pipe_monitor():
    q = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=5)
    caught = []

    def busy_loop():
        try:
            while True:
                r.dequeue(indefinite=True)
        except Exception as e:  # vLLM's worker_main catches Exception
            caught.append((e, time.monotonic()))

    t = threading.Thread(target=busy_loop)
    t.start()
    q.enqueue("one")
    wait_until(lambda: not r.readable() and r.hotloop_source.parked, what="the busy loop parking after 'one'")
    t0 = time.monotonic()
    r.shutdown()
    t.join(5)
    assert not t.is_alive()
    (err, when), = caught
    assert isinstance(err, RuntimeError) and isinstance(err, ClosedError)  # vLLM's "cancelled" is a RuntimeError
    assert when - t0 < 1.0
    assert r.shutting_down
    with pytest.raises(ClosedError):
        r.dequeue(timeout=1)
    r.close()
    q.close()


def test_a_reader_that_raises_mid_read_releases_the_message():
    q = MessageQueue(1, 1, max_chunk_bytes=4096)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=5)
    q.enqueue("first")
    q.enqueue("second")
    with pytest.raises(ZeroDivisionError):
        with r.acquire_read(timeout=1) as view:
            assert len(view) > 0
            1 / 0
    assert r.dequeue(timeout=1) == "second"
    for i in range(200):  # the ring keeps turning: nothing was left held
        q.enqueue(b"y" * 1000, timeout=1)
        assert r.dequeue(timeout=1) == b"y" * 1000
    r.close()
    q.close()


def test_readers_are_wait_any_sources_and_writers_cannot_dequeue():
    q = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=5)
    assert wait_any([r], timeout=0.01) == []
    q.enqueue({"x": 1})
    assert wait_any([r], timeout=1) == [r]
    assert r.broadcast_object() == {"x": 1}
    assert q.broadcast_object("b") == "b" and r.dequeue(timeout=1) == "b"
    with pytest.raises(RuntimeError, match="only readers"):
        q.dequeue(timeout=0)
    with pytest.raises(RuntimeError, match="cannot enqueue"):
        r.enqueue(1)
    r.close()
    q.close()


def _remote_reader(handle, rank, results):
    q = MessageQueue.create_from_handle(handle, rank)
    try:
        results.put((rank, q.dequeue(timeout=30)["t"].sum().item()))
    finally:
        q.close()


def test_remote_readers_by_vllm_rank_and_rank_minus_one():
    # ranks 1 and 3 read shared memory, 0 and 2 read over TCP (CurveZMQ)
    q = MessageQueue(4, 2, local_reader_ranks=[1, 3], connect_ip="127.0.0.1")
    h = q.export_handle()
    assert h.remote_reader_ranks == [0, 2] and h.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    results = CTX.Queue()
    procs = [CTX.Process(target=_remote_reader, args=(h, r, results)) for r in range(4)]
    for p in procs:
        p.start()
    q.wait_until_ready(timeout=30)
    q.enqueue({"t": torch.ones(1000)})
    assert dict(results.get(timeout=30) for _ in procs) == {r: 1000.0 for r in range(4)}
    for p in procs:
        p.join(30)
    q.shutdown()
    q.close()

    # vLLM's single-reader queue on another node: the reader attaches with rank -1
    single = MessageQueue(1, 0, connect_ip="127.0.0.1")
    p = CTX.Process(target=_remote_reader, args=(single.export_handle(), -1, results))
    p.start()
    single.wait_until_ready(timeout=30)
    single.enqueue({"t": torch.ones(5)})
    assert results.get(timeout=30) == (-1, 5.0)
    p.join(30)
    single.shutdown()
    single.close()


def test_handle_pickled_and_workers_started_from_several_threads_at_once():
    # vLLM 0.33 starts a node's workers from a thread pool (CUDA, spawn): each thread pickles the same exported
    # handle into its process's arguments while the others do. Two shared-memory and two TCP readers.
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    from spawned_queue_reader import read_all  # a module without torch: the children start in a second or two

    spawn, count, ranks = mp.get_context("spawn"), 300, range(4)
    q = MessageQueue(4, 2, local_reader_ranks=[0, 1], connect_ip="127.0.0.1")
    handle = q.export_handle()
    results = spawn.Queue()
    barrier = threading.Barrier(len(ranks))

    def start(rank):
        barrier.wait()  # every thread pickles and starts at once
        blobs = {pickle.dumps(handle) for _ in range(50)}
        assert len(blobs) == 1, "pickling the handle from several threads gave different bytes"
        p = spawn.Process(target=read_all, args=(blobs.pop(), rank, count, results))
        p.start()
        return p

    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        procs = list(pool.map(start, ranks))
    try:
        q.wait_until_ready(timeout=120)
        for i in range(count):
            q.enqueue({"i": i})
        got = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        q.shutdown()
        q.close()
    assert got == {r: list(range(count)) for r in ranks}
    assert all(p.exitcode == 0 for p in procs)


def test_bad_ranks_and_mixed_handles_give_clear_errors():
    q = MessageQueue(2, 2)
    h = q.export_handle()
    with pytest.raises(BadHandleError, match="rank 5 is not one of its readers"):
        MessageQueue.create_from_handle(h, 5)

    class Handle:  # what vLLM's own MessageQueue exports, as far as the check can tell
        local_reader_ranks = [0]
    Handle.__module__ = "vllm.distributed.device_communicators.shm_broadcast"
    with pytest.raises(BadHandleError, match="HOTLOOP_VLLM=1"):
        MessageQueue.create_from_handle(Handle(), 0)
    with pytest.raises(BadHandleError, match="not a hotloop.vllm MessageQueue handle"):
        MessageQueue.create_from_handle(("not", "a", "handle"), 0)
    # vLLM's own create_from_handle reads these first: it gets a clear error too
    with pytest.raises(BadHandleError, match="every process of the deployment"):
        h.buffer_handle
    with pytest.raises(BadHandleError, match="every process of the deployment"):
        h.remote_addr_ipv6
    with pytest.raises(ValueError, match="local_reader_ranks"):
        MessageQueue(2, 2, local_reader_ranks=[0])
    for r in (MessageQueue.create_from_handle(h, 0), MessageQueue.create_from_handle(h, 1)):
        r.close()
    q.close()


def _attach_then_die(handle, rank):
    reader = MessageQueue.create_from_handle(handle, rank)  # held, never closed: the process just ends
    os._exit(0 if reader else 1)


def test_dead_reader_fails_the_writer_and_dead_writer_fails_the_reader():
    q = MessageQueue(1, 1)
    p = CTX.Process(target=_attach_then_die, args=(q.export_handle(), 0))
    p.start()
    q.wait_until_ready(timeout=30)
    p.join(30)
    with pytest.raises(DeadPeerError):  # found when the writer has to wait for it: once the ring is full
        for _ in range(1000):
            q.enqueue(b"z" * 100000, timeout=5)
    q.close()

    r_pipe, w_pipe = CTX.Pipe(duplex=False)

    def writer_then_die():
        w = MessageQueue(1, 1)
        w_pipe.send(w.export_handle())
        w.wait_until_ready(timeout=30)
        w.enqueue("last words")
        os._exit(0)

    wp = CTX.Process(target=writer_then_die)
    wp.start()
    r = MessageQueue.create_from_handle(r_pipe.recv(), 0)
    assert r.dequeue(timeout=30) == "last words"
    with pytest.raises(DeadPeerError):
        r.dequeue(indefinite=True)
    wp.join(30)
    r.close()
    r_pipe.close()
    w_pipe.close()


def test_long_wait_without_timeout_logs_vllms_line(monkeypatch, caplog):
    monkeypatch.setattr(vmq, "_warning_interval", lambda: 0.1)
    q = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=5)
    timer = threading.Timer(0.35, q.enqueue, args=("done",))
    with caplog.at_level(logging.INFO, logger="vllm.hotloop"):
        timer.start()
        assert r.dequeue() == "done"
    timer.join()
    assert sum("No available shared memory broadcast block" in m for m in caplog.messages) >= 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.hotloop"):
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=0.2, indefinite=True)
    assert not caplog.messages
    r.close()
    q.close()


def test_plugin_does_nothing_unless_enabled_and_names_supported_versions(monkeypatch, caplog):
    import hotloop.vllm as hv

    monkeypatch.delenv("HOTLOOP_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert hv.enabled_by_env()[0] is False
    hv.register()  # not enabled: nothing happens, nothing is imported
    assert not hv.is_installed()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,hotloop")
    assert hv.enabled_by_env()[0] is True
    monkeypatch.setenv("HOTLOOP_VLLM", "0")
    assert hv.enabled_by_env()[0] is False
    for version in ("0.30.0", "0.31.0+cpu", "0.32.0+cpu", "0.33.0", "0.32.1"):  # releases and a patch release
        assert hv.check_version(version) == version
    for version in ("0.29.2", "0.34.0", "0.33.0rc1", "0.33.1.dev3+g1234"):  # outside the range, or not a release
        with pytest.raises(RuntimeError, match=f"supports vLLM 0.30.0, 0.31.0, 0.32.0, 0.33.0 .*this is vLLM {re.escape(version)}"):
            hv.check_version(version)
    # enabled on a machine whose vLLM is missing or unsupported: a warning, vLLM's own queue stays
    monkeypatch.setenv("HOTLOOP_VLLM", "1")
    monkeypatch.setattr(hv, "vllm_version", lambda: "0.1.0")
    with caplog.at_level(logging.WARNING, logger="vllm.hotloop"):
        hv.register()
    assert any("supports vLLM 0.30.0" in m and "this is vLLM 0.1.0" in m for m in caplog.messages)
    assert not hv.is_installed()


def test_step_paced_wait_yields_then_parks_and_loses_nothing(monkeypatch):
    from hotloop.vllm import step_wait

    monkeypatch.setenv("HOTLOOP_VLLM_YIELD_US", "50000")  # a 50 ms yield budget: long enough to tell the phases
    q = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    paced = r._paced
    q.wait_until_ready()
    q.enqueue(_step(0))
    assert r.dequeue(indefinite=True)[1][0]["step"] == 0  # there at once: within the budget
    assert (paced.yielded, paced.parked) == (1, 0)

    threading.Timer(0.3, q.enqueue, args=(_step(1),)).start()  # after the budget: found by the parked phase
    assert r.dequeue(indefinite=True)[1][0]["step"] == 1
    assert paced.parked == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):  # the caller's timeout holds across both phases
        r.dequeue(timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert r._policy is paced.park_policy  # the yield policy never outlives its phase

    paced.ema_s = 1.0  # waits far above the cap (idle, long steps): park at once
    assert paced.budget_s(0.05) == 0.0
    paced.ema_s = 0.001
    assert paced.budget_s(0.05) == 0.05  # steps within the cap: yield through the whole cap
    assert paced.budget_s(0.0) == 0.0
    r.shutdown()
    with pytest.raises(ClosedError):  # shutdown still ends a paced wait
        r.dequeue(indefinite=True)
    r.close()
    q.close()


def test_step_paced_wait_is_off_unless_asked_and_checks_its_setting(monkeypatch):
    from hotloop.vllm import step_wait

    monkeypatch.delenv("HOTLOOP_VLLM_YIELD_US", raising=False)
    monkeypatch.delenv("HOTLOOP_VLLM_PACED", raising=False)
    monkeypatch.setattr(step_wait, "model_on_host", lambda: False)  # a GPU platform's rule: no yield budget
    assert step_wait.cap_us() is None
    q = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.enqueue(_step(0))
    assert r.dequeue()[0] == "execute_model"
    assert (r._paced.yielded, r._paced.parked) == (0, 1)  # no yield phase: hotloop's own wait
    r.close()
    q.close()
    for bad in ("lots", "-5", "nan"):  # a bad setting fails the attach with its name, not a step later
        monkeypatch.setenv("HOTLOOP_VLLM_YIELD_US", bad)
        q = MessageQueue(1, 1)
        with pytest.raises(ValueError, match="HOTLOOP_VLLM_YIELD_US"):
            MessageQueue.create_from_handle(q.export_handle(), 0)
        q.close()


def test_the_readers_wait_follows_the_host_rule_and_every_switch_overrides_it(monkeypatch):
    """step_wait.choose: vLLM's CPU platform (the model on the host's cores) -> a 1 ms yield budget; the model off
    the host -> paced with a core per process (the front end's too), the 1 ms yield budget where the front end
    makes the processes one too many, plain where the engine core and workers outnumber the cores;
    HOTLOOP_VLLM_YIELD_US, then HOTLOOP_VLLM_PACED, override it."""
    from hotloop.vllm import step_wait

    monkeypatch.delenv("HOTLOOP_VLLM_YIELD_US", raising=False)
    monkeypatch.delenv("HOTLOOP_VLLM_PACED", raising=False)
    choose = step_wait.choose
    for workers, cores in ((1, 2), (2, 2), (1, 64), (8, 64)):
        wait = choose(workers, on_host=True, cores=cores)  # the CPU build, whatever the host's size
        assert (wait.kind, wait.cap_us) == ("yield", step_wait.HOST_COMPUTE_YIELD_US), wait
        assert wait.policy() is None  # the budget's park phase is the plain wait
    # engine core + 1 worker on 2 cores, the front end one too many: the yield budget, then the plain park
    wait = choose(1, on_host=False, cores=2)
    assert (wait.kind, wait.cap_us, wait.policy()) == ("yield", step_wait.HOST_COMPUTE_YIELD_US, None), wait
    assert "front end" in wait.why
    assert choose(7, on_host=False, cores=8).kind == "yield"
    assert choose(1, on_host=False, cores=3).kind == "paced"  # a core per process, the front end's too
    assert choose(7, on_host=False, cores=9).kind == "paced"
    assert choose(1, on_host=False, cores=3).policy().paced
    assert choose(2, on_host=False, cores=2).kind == "plain"  # 3 processes, 2 cores
    assert choose(4, on_host=False, cores=2).kind == "plain"
    assert "outnumber" in choose(2, on_host=False, cores=2).why
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "1")
    assert choose(2, on_host=True, cores=2).kind == "paced"
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "0")
    assert choose(1, on_host=False, cores=8).kind == "plain"
    assert choose(1, on_host=True, cores=8).why == "HOTLOOP_VLLM_PACED=0"
    monkeypatch.setenv("HOTLOOP_VLLM_YIELD_US", "250")  # the budget wins over PACED
    assert (choose(1, on_host=False, cores=8).kind, choose(1, on_host=False, cores=8).cap_us) == ("yield", 250.0)
    monkeypatch.setenv("HOTLOOP_VLLM_YIELD_US", "0")  # no budget: PACED decides
    assert choose(2, on_host=True, cores=2).kind == "plain"
    monkeypatch.delenv("HOTLOOP_VLLM_PACED")
    assert choose(2, on_host=True, cores=2).kind == "paced"
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "maybe")
    with pytest.raises(ValueError, match="HOTLOOP_VLLM_PACED"):
        choose(1, on_host=True, cores=2)


@pytest.mark.parametrize("on_host, cores, kind", [(True, 2, "yield"), (False, 2, "plain"), (False, 3, "yield"),
                                                  (False, 64, "paced")])
def test_a_reader_takes_the_hosts_wait_at_its_first_read(monkeypatch, on_host, cores, kind):
    """As in vLLM's engine core: the step broadcast to two local workers is written here, then a worker's answer
    queue (one reader) is read. Its reader counts this process's deployment (the broadcast's two workers, the
    cores its writer stamped) when it first reads, and loses nothing while it does."""
    from hotloop.vllm import step_wait

    monkeypatch.delenv("HOTLOOP_VLLM_YIELD_US", raising=False)
    monkeypatch.delenv("HOTLOOP_VLLM_PACED", raising=False)
    monkeypatch.setattr(step_wait, "model_on_host", lambda: on_host)
    monkeypatch.setattr(step_wait, "HOST_CORES", cores)
    monkeypatch.setattr(step_wait, "HOST_QUOTA", None)  # whatever cgroup the suite runs in
    monkeypatch.setattr(vmq, "_deployment", {"workers": 0, "cores": 0})
    monkeypatch.setattr(step_wait, "chosen", [])
    broadcast = MessageQueue(2, 2)
    assert broadcast.export_handle().host_cores == cores
    answers = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(answers.export_handle(), 0)
    assert step_wait.chosen == []  # not decided at attach: the process may not have seen its broadcast yet
    for i in range(3):
        answers.enqueue(_step(i))
    assert [r.dequeue(timeout=5)[1][0]["step"] for _ in range(3)] == [0, 1, 2]
    [(name, wait)] = step_wait.chosen
    assert (name, wait.kind) == (r.name, kind), wait
    assert r._paced.cap_s == (step_wait.HOST_COMPUTE_YIELD_US / 1e6 if kind == "yield" else 0.0)
    assert r._policy.paced == (kind == "paced")
    assert r._paced.park_policy is r._policy
    r.close()
    answers.close()
    broadcast.close()


@pytest.mark.parametrize("chains", [True, False])
def test_a_steps_second_broadcast_is_read_without_a_park_between(monkeypatch, chains):
    """The async path's two-message step: the worker reads execute_model, then sample_tokens, which the engine core
    writes a moment later. With chained reads the second read yields through the gap (no park: the counters say
    so); without them it parks each time (the writer waits until the reader sleeps on the ring, then writes).
    The budgets are widened so that a loaded machine's scheduling delays stay inside them."""
    from conftest import thread_parked_in_segment

    from hotloop.vllm import chained_reads, step_wait

    monkeypatch.delenv("HOTLOOP_VLLM_YIELD_US", raising=False)
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "0")  # the plain wait: spin 20 us, yield 10 us, park
    monkeypatch.setenv("HOTLOOP_VLLM_CHAINS", "1" if chains else "0")
    monkeypatch.setattr(chained_reads, "CHAIN_GAP_US", 10_000.0)
    monkeypatch.setattr(chained_reads, "CHAIN_YIELD_US", 2_000_000.0)
    steps = 12
    q = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready()
    reader = threading.current_thread()
    got_first = threading.Event()

    def engine_core():
        for n in range(steps):
            time.sleep(0.05)  # a step apart (5x the chain's gap): the read after sample_tokens is never chained
            got_first.clear()
            q.enqueue(("execute_model", (n,), {}, 0))
            got_first.wait(10)
            if chains:
                time.sleep(0.0005)  # the engine core's work between the two broadcasts (the reader yields)
            else:
                wait_until(lambda: thread_parked_in_segment(reader, q.name), what="reader parked in the gap")
            q.enqueue(("sample_tokens", (n,), {}, 0))

    writer = threading.Thread(target=engine_core)
    writer.start()
    try:
        for n in range(steps):
            assert r.dequeue(timeout=30) == ("execute_model", (n,), {}, 0)
            got_first.set()
            assert r.dequeue(timeout=30) == ("sample_tokens", (n,), {}, 0)
    finally:
        writer.join(30)
    after_first = r._paced.chain.stats()["execute_model"]
    assert after_first["reads"] == steps
    if chains:
        # the first step teaches the gap (it parks); every later one yields through it
        assert after_first["chained"] == steps - 1 and after_first["parks"] <= 1, after_first
    else:
        assert after_first["chained"] == 0 and after_first["parks"] == steps, after_first
    assert r._paced.chain.stats()["sample_tokens"]["chained"] == 0  # a step apart: never chained
    assert step_wait.chain_stats()["execute_model"]["reads"] >= steps
    r.close()
    q.close()
