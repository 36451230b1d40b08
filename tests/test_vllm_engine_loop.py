"""The engine-core loop's parts without vLLM (``hotloop/vllm/engine_loop.py``): the input queue vLLM's engine core
uses (queue.Queue's calls, a wait source; converted in place with nothing lost while a producer thread puts), and
the step wait over response queues and inputs, on futures built as vLLM 0.32's ``FutureWrapper`` builds them
(``collective_rpc``'s ``get_response`` closure over ``response_mqs`` and ``deadline``). The whole loop inside vLLM's
engine is tested in test_vllm_loop.py."""

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

import pytest

from hotloop import ClosedError, WaitPolicy, wait_any
from hotloop.vllm import MessageQueue
from hotloop.vllm.engine_loop import EngineInputQueue, StepWait
from hotloop.vllm.queue_slot import QueueSlot


# ---- the input queue ----

def test_engine_input_queue_keeps_queue_queue_semantics():
    q = EngineInputQueue()
    assert q.empty() and q.qsize() == 0 and not q.full()
    with pytest.raises(queue.Empty):
        q.get(block=False)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    for i in range(5):
        q.put_nowait(i) if i % 2 else q.put(i)
    assert q.qsize() == 5 and wait_any([q], timeout=0) == [q]
    assert [q.get(block=False), q.get_nowait()] + q.drain() == [0, 1, 2, 3, 4]
    assert wait_any([q], timeout=0) == []


def test_engine_input_queue_blocking_get_is_woken_by_another_thread():
    q = EngineInputQueue()
    threading.Timer(0.05, q.put_nowait, args=("x",)).start()
    assert q.get() == "x"  # block=True, no timeout


class _Core:
    input_queue = QueueSlot("input_queue", EngineInputQueue)


def test_the_slot_converts_vllms_queue_in_place_without_losing_or_reordering_items():
    n = 20000
    for _ in range(5):
        core = _Core()
        core.input_queue = queue.Queue()  # what vLLM's constructor does, before the plugin loads
        core.__dict__["input_queue"].put_nowait(-1)  # an item put before the conversion
        go = threading.Event()

        def produce():
            go.wait()
            for i in range(n):
                core.input_queue.put_nowait(i)  # the input thread's call: every put reads the slot

        t = threading.Thread(target=produce)
        t.start()
        go.set()
        time.sleep(0.001)
        got = []
        while len(got) < n + 1:
            q = core.input_queue  # converts on the first read
            assert isinstance(q, EngineInputQueue)
            got += q.drain()
        t.join()
        assert got == [-1] + list(range(n))
        assert core.input_queue.empty()


def test_the_slot_leaves_other_queues_alone():
    core = _Core()
    mine = EngineInputQueue()
    core.input_queue = mine
    assert core.input_queue is mine
    with pytest.raises(AttributeError):
        _ = _Core().input_queue


# ---- the step wait ----

class FutureWrapper(Future):
    """vLLM 0.32's FutureWrapper (v1/executor/multiproc_executor.py): futures resolve in FIFO order."""

    def __init__(self, futures_queue, get_response):
        self.futures_queue = futures_queue
        self.get_response = get_response
        super().__init__()
        self.futures_queue.appendleft(self)

    def result(self, timeout=None):
        while not self.done():
            self.futures_queue.pop()._wait_for_response()
        return super().result()

    def _wait_for_response(self):
        try:
            self.set_result(self.get_response())
        except Exception as e:  # noqa: BLE001
            self.set_exception(e)


def rpc(futures, response_mqs, method="execute_model", timeout=60.0):
    """A non-blocking collective_rpc's future, its get_response closure as vLLM 0.32 writes it (a step has a timeout:
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def get_response():
        responses = []
        for mq in response_mqs:
            dequeue_timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                status, result = mq.dequeue(timeout=dequeue_timeout)
            except TimeoutError as e:
                raise TimeoutError(f"RPC call to {method} timed out.") from e
            responses.append(result)
        return responses[0]

    return FutureWrapper(futures, get_response)


class FakeCore:
    """What StepWait uses of vLLM's EngineCoreProc: input_queue and _handle_client_request."""

    def __init__(self, on_request=None):
        self.input_queue = EngineInputQueue()
        self.handled = []
        self.on_request = on_request

    def _handle_client_request(self, request_type, request):
        self.handled.append((request_type, request, time.monotonic()))
        if self.on_request:
            self.on_request(request_type, request)


def test_inputs_are_handled_while_the_step_runs_and_the_response_ends_the_wait(response_queue):
    writer, reader = response_queue
    core = FakeCore()
    futures = deque()
    step = rpc(futures, [reader])
    missed = []

    def step_thread():  # the step answers only once each input has been handled: a loop that waits for the
        for i in range(3):  # step before handling inputs never sees its answer
            core.input_queue.put_nowait(("ADD", i))
            deadline = time.monotonic() + 10
            while len(core.handled) <= i and time.monotonic() < deadline:
                time.sleep(0.001)
            if len(core.handled) <= i:
                missed.append(i)
        writer.enqueue((0, "output"))

    t = threading.Thread(target=step_thread)
    t.start()
    StepWait(core).wait_for(step)
    t.join()
    assert not missed, f"inputs {missed} were not handled while the step ran"
    assert step.result() == "output"
    assert [r for _, r, _ in core.handled] == [0, 1, 2]


def test_futures_resolve_in_vllms_order(response_queue):
    writer, reader = response_queue
    futures = deque()
    first, second = rpc(futures, [reader]), rpc(futures, [reader])
    writer.enqueue((0, "first"))
    writer.enqueue((0, "second"))
    StepWait(FakeCore()).wait_for(second)
    assert (first.result(), second.result()) == ("first", "second")


def test_the_futures_deadline_fails_it_with_vllms_timeout_message(response_queue):
    _, reader = response_queue
    futures = deque()
    step = rpc(futures, [reader], timeout=0.1)
    t0 = time.monotonic()
    StepWait(FakeCore()).wait_for(step)
    assert 0.09 <= time.monotonic() - t0 < 5
    with pytest.raises(TimeoutError, match="RPC call to execute_model timed out."):
        step.result()


def test_a_response_queue_shut_down_during_the_step_ends_the_wait(response_queue):
    _, reader = response_queue
    futures = deque()
    step = rpc(futures, [reader])
    threading.Timer(0.05, reader.shutdown).start()  # what vLLM's executor does when a worker dies
    StepWait(FakeCore()).wait_for(step)
    with pytest.raises(ClosedError):
        step.result()


def test_an_input_that_raises_leaves_the_step_in_flight_and_the_wait_reusable(response_queue):
    writer, reader = response_queue

    def fail(request_type, request):
        if request_type == "EXECUTOR_FAILED":
            raise RuntimeError("Executor failed.")

    core = FakeCore(fail)
    wait = StepWait(core)
    futures = deque()
    step = rpc(futures, [reader])
    core.input_queue.put_nowait(("EXECUTOR_FAILED", b""))
    core.input_queue.put_nowait(("ADD", "behind"))
    with pytest.raises(RuntimeError, match="Executor failed."):
        wait.wait_for(step)
    assert not wait.busy and not step.done()
    assert core.input_queue.get_nowait() == ("ADD", "behind")  # the input behind the failing one is still queued
    writer.enqueue((0, "late"))
    wait.wait_for(step)
    assert step.result() == "late"


def test_a_future_of_other_queues_is_left_to_vllms_own_wait():
    core = FakeCore()
    futures = deque()
    not_hotloop = queue.Queue()  # no hotloop_source: StepWait cannot wait on it
    step = FutureWrapper(futures, lambda: not_hotloop.get(timeout=5)[1])
    core.input_queue.put_nowait(("ADD", 0))
    StepWait(core).wait_for(step)  # returns at once; nothing handled, the future still pending
    assert not step.done() and core.handled == []
    not_hotloop.put((0, "x"))
    assert step.result() == "x"


# ---- the per-hop timeline's arithmetic ----

def test_timeline_hops_split_each_requests_time_to_first_token():
    from hotloop.vllm.timeline import HOPS, SEND_HOPS, hops

    ms = 1_000_000
    front = {"a": [0, 20 * ms], "b": [5 * ms, 40 * ms], "lost": [0, 1]}
    core = {"requests": {"a-0123abcd": [1 * ms, 2 * ms, False], "b-89abcdef": [6 * ms, 7 * ms, True]},
            "steps": [[1, 3 * ms, None, 12 * ms, 13 * ms, ["a-0123abcd"]],
                      [2, 14 * ms, 15 * ms, 30 * ms, 31 * ms, ["b-89abcdef"]]]}
    worker = [[1, 4 * ms, 11 * ms, None, None], [2, 16 * ms, 20 * ms, 22 * ms, 28 * ms]]
    got = hops(front, core, worker)
    assert got["time to first token"] == [20.0, 35.0]  # "lost" has no engine-side stamps: left out
    assert [got[h][0] for h in HOPS] == [1.0, 1.0, 1.0, 1.0, 7.0, 1.0, 1.0, 7.0]
    # b: its step sampled in a second call, so the worker's step ends at the sampling call's end
    assert [got[h][1] for h in HOPS] == [1.0, 1.0, 7.0, 2.0, 12.0, 2.0, 1.0, 9.0]
    for i in range(2):
        assert sum(got[h][i] for h in HOPS) == got["time to first token"][i]
    # with the front end's send stamps (a's only), the first hop splits in two for the requests that have one
    got = hops(front, core, worker, {"a-0123abcd": ms // 4})
    assert got[SEND_HOPS[0]] == [0.25] and got[SEND_HOPS[1]] == [0.75]
    assert got[SEND_HOPS[0]][0] + got[SEND_HOPS[1]][0] == got[HOPS[0]][0]
    assert SEND_HOPS[0] not in hops(front, core, worker, {})


# ---- the paced wait (step_wait.py, engine_loop.py) ----

def _attached_policy(n_reader, n_local_reader, rank, policy=None):
    """The policy reader `rank` of a fresh queue waits with once it has read a message."""
    writer = MessageQueue(n_reader, n_local_reader, max_chunk_bytes=1 << 16)
    try:
        reader = MessageQueue.create_from_handle(writer.export_handle(), rank, policy=policy)
        writer.wait_until_ready(10)
        writer.enqueue("step")
        assert reader.dequeue(timeout=10) == "step"
        reader.close()
        return reader._policy
    finally:
        writer.close()


def test_shared_memory_readers_wait_paced_by_default_and_the_setting_turns_it_off(monkeypatch):
    """Where the model is off the host and each process has a core (step_wait.choose's paced case)."""
    from hotloop.vllm import step_wait

    monkeypatch.delenv("HOTLOOP_VLLM_PACED", raising=False)
    monkeypatch.delenv("HOTLOOP_VLLM_YIELD_US", raising=False)
    monkeypatch.setattr(step_wait, "model_on_host", lambda: False)
    monkeypatch.setattr(step_wait, "HOST_CORES", 8)
    assert _attached_policy(1, 1, 0).paced
    assert not _attached_policy(1, 0, 0).paced, "a network reader keeps its own policy (it parks at once)"
    assert not _attached_policy(1, 1, 0, WaitPolicy()).paced, "a policy passed in is used as given"
    for env, value in (("HOTLOOP_VLLM_PACED", "0"), ("HOTLOOP_VLLM_YIELD_US", "100")):
        monkeypatch.setenv(env, value)
        assert not _attached_policy(1, 1, 0).paced, f"{env}={value}"
        monkeypatch.delenv(env)
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "sometimes")
    with pytest.raises(ValueError, match="HOTLOOP_VLLM_PACED"):
        _attached_policy(1, 1, 0)


def test_step_wait_is_paced_and_learns_the_step_from_the_broadcast(response_queue, monkeypatch):
    monkeypatch.delenv("HOTLOOP_VLLM_PACED", raising=False)
    writer, reader = response_queue
    wait = StepWait(FakeCore())
    assert wait.policy.paced
    futures = deque()
    for i in range(8):
        step = rpc(futures, [reader])
        step._hotloop_sent_ns = time.monotonic_ns()  # as the installed FutureWrapper.__init__ stamps it (below)
        t = threading.Timer(0.005, writer.enqueue, args=((0, i),))  # the "step" answers 5 ms after the broadcast
        t.start()
        wait.wait_for(step)
        t.join()
        assert step.result() == i
    st = wait.policy.paced_stats()
    assert st["samples"] >= 4, st
    assert 4_000 <= wait.policy.interval_us < 100_000, "broadcast -> answer, not answer -> answer"
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "0")
    assert not StepWait(FakeCore()).policy.paced


def test_the_installed_future_init_stamps_when_the_call_was_broadcast():
    from hotloop.vllm.engine_loop import _stamped_init

    class Stamped(FutureWrapper):
        pass

    Stamped.__init__ = _stamped_init(FutureWrapper.__init__)
    futures = deque()
    before = time.monotonic_ns()
    f = Stamped(futures, lambda: "answer")
    assert before <= f._hotloop_sent_ns <= time.monotonic_ns()
    assert list(futures) == [f] and f.result() == "answer", "vLLM's own __init__ still runs"
