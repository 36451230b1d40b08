"""The engine: scheduler lifecycle, identical outputs in every wait mode and executor (TP=1 and TP=2), inputs
during a long step, bad requests, abort, and failures (worker SIGKILL, engine SIGKILL, parent death, rank 0's
answers ending before the report of why)."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import require_torch

torch = require_torch()

from hotloop.engine import AddRequest, EngineCore, ExecutorError, RequestError  # noqa: E402
from hotloop.engine import tokenizer as tk  # noqa: E402
from hotloop.engine.client import AsyncEngineClient, EngineClient, EngineDeadError  # noqa: E402
from hotloop.engine.executors import Executor, executor_names, register_executor  # noqa: E402
from hotloop.engine.executors.worker_group import REPORT_GRACE_S, STEP_CHUNK_BYTES, WorkerGroupExecutor  # noqa: E402
from hotloop.engine.scheduler import Scheduler  # noqa: E402
from conftest import wait_until  # noqa: E402
from hotloop import Flag, MessageQueue  # noqa: E402


PROMPTS = [tk.encode(f"request {i}: " + "abc" * i) for i in range(6)]


def _spec(i, max_tokens=12, **kw):
    return AddRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], max_tokens, **kw)


# ---- scheduler ----


def test_scheduler_lifecycle_chunked_prefill_and_limits():
    s = Scheduler(tk.VOCAB_SIZE, 256, max_num_seqs=2, max_tokens_per_step=8)
    s.add(AddRequest("a", list(range(1, 13)), 3))  # a 12-token prompt: two chunks at 8 tokens per step
    s.add(AddRequest("b", [1, 2], 2))
    s.add(AddRequest("c", [1], 1))
    out = s.schedule()
    assert [(g.request_id, len(g.token_ids), g.sample) for g in out.segments] == [("a", 8, False)]
    assert s.update([]) == []
    out = s.schedule()
    assert [(g.request_id, len(g.token_ids), g.start, g.sample) for g in out.segments] == [
        ("a", 4, 8, True), ("b", 2, 0, True)]
    outs = s.update([7, 8])
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outs] == [("a", [7], False), ("b", [8], False)]
    out = s.schedule()  # max_num_seqs=2: c waits until one finishes
    assert [(g.request_id, g.token_ids, g.start) for g in out.segments] == [("a", [7], 12), ("b", [8], 2)]
    outs = s.update([9, 10])
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", False, None), ("b", True, "length")]
    out = s.schedule()
    assert [g.request_id for g in out.segments] == ["a", "c"] and out.free_ids == ["b"]  # b's KV cache dropped
    outs = s.update([11, tk.EOS])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "length"), ("c", "stop")]
    assert not s.has_work
    assert set(s.schedule().free_ids) == {"a", "c"}


def test_scheduler_rejects_bad_requests_and_keeps_the_others():
    s = Scheduler(tk.VOCAB_SIZE, 64)
    s.add(AddRequest("ok", [1, 2], 2))
    for spec, match in [(AddRequest("e", [], 2), "empty prompt"),
                        (AddRequest("v", [1, 999], 2), "outside the vocabulary"),
                        (AddRequest("z", [1], 0), "max_tokens must be positive"),
                        (AddRequest("h", [1], 10**9), "exceeds the model's length limit"),
                        (AddRequest("ok", [1], 2), "already in use")]:
        with pytest.raises(RequestError, match=match):
            s.add(spec)
    assert list(s.requests) == ["ok"]


def test_scheduler_abort_waiting_running_in_flight_unknown_and_finished():
    s = Scheduler(tk.VOCAB_SIZE, 64, max_num_seqs=1)
    s.add(AddRequest("run", [1, 2], 5))
    s.add(AddRequest("wait", [1], 5))
    s.schedule()  # "run" in flight
    assert [o.finish_reason for o in s.abort(["wait", "run", "unknown"])] == ["abort", "abort"]
    assert s.update([5]) == []  # the in-flight token of an aborted request is dropped
    assert not s.has_work and s.schedule().free_ids == ["run"]
    s.update([])
    s.add(AddRequest("run", [1], 1))  # the id is free again once finished
    s.schedule()
    assert s.update([3])[0].finish_reason == "length"
    assert s.abort(["run"]) == []  # abort after finish: nothing


# ---- the engine core ----


def _run_core(core: EngineCore, specs, extra=None):
    """Feed specs, run the core in a thread until every request finished; return {id: (tokens, reason)}."""
    t = threading.Thread(target=core.run)
    t.start()
    for spec in specs:
        core.input_queue.put(spec)
    if extra:
        extra(core)
    got, done = {}, set()
    while len(done) < len(specs):
        for o in core.output_queue.get(timeout=60):
            toks, _ = got.get(o.request_id, ([], None))
            got[o.request_id] = (toks + o.new_token_ids, o.finish_reason or o.error)
            if o.finished:
                done.add(o.request_id)
    core.input_queue.put(None)
    t.join(30)
    assert not t.is_alive()
    return got


SPECS = [_spec(i, max_tokens=10 + i, temperature=0.8 if i % 3 == 2 else 0.0, seed=i) for i in range(6)]


@pytest.fixture(scope="module")
def reference():
    return _run_core(EngineCore("tiny", wait_mode="block", max_tokens_per_step=24), SPECS)


@pytest.mark.parametrize("mode", ["block", "poll", "hotloop"])
def test_outputs_are_identical_in_every_wait_mode(mode, reference):
    assert _run_core(EngineCore("tiny", wait_mode=mode, max_tokens_per_step=24), SPECS) == reference
    assert all(reason == "length" for _, reason in reference.values())


@pytest.mark.parametrize("tp,mode", [(1, "hotloop"), (2, "hotloop"), (2, "poll"), (2, "block")])
def test_multiproc_executor_matches_in_process(tp, mode, reference):
    core = EngineCore("tiny", executor="multiproc", tp=tp, wait_mode=mode, max_tokens_per_step=24)
    assert _run_core(core, SPECS) == reference


@pytest.mark.parametrize("mode", ["block", "poll", "hotloop"])
def test_inputs_during_a_long_step_reach_the_scheduler_only_in_poll_and_hotloop(mode):
    core = EngineCore("tiny", wait_mode=mode, step_delay_s=0.3)

    def late_arrivals(core):
        wait_until(lambda: core.executor.in_flight, what="the first step (0.3 s) starting")
        if mode == "hotloop":  # and the loop parked on {the step, the inputs}
            wait_until(lambda: core.input_queue.parked, what="the engine loop parking")
        for i in range(3):
            core.input_queue.put(AddRequest(f"late{i}", [1, 2, 3], 2, arrival_ns=time.monotonic_ns()))

    _run_core(core, [_spec(0, max_tokens=2)], extra=late_arrivals)
    if mode == "block":
        assert core.stats.added_during_step == 0
        assert min(list(core.stats.queue_wait_ns)[1:]) > 100e6  # they waited for the step to end
    else:
        assert core.stats.added_during_step == 3
        assert max(list(core.stats.queue_wait_ns)[1:]) < 50e6


def test_bad_requests_get_errors_and_the_engine_serves_the_rest():
    core = EngineCore("tiny")
    t = threading.Thread(target=core.run)
    t.start()
    good = _spec(0, max_tokens=3)
    for spec in [good, AddRequest("empty", [], 3), AddRequest("oov", [300], 3), AddRequest("zero", [1], 0),
                 AddRequest("huge", [1], 10**6), AddRequest(good.request_id, [1], 3), 42]:
        core.input_queue.put(spec)
    errors, tokens = {}, []
    while True:
        try:
            batch = core.output_queue.get(timeout=30)
        except Exception:
            break
        for o in batch:
            if o.error:
                errors.setdefault(o.request_id, []).append(o.error)
            else:
                tokens += o.new_token_ids
                if o.finished:
                    assert o.finish_reason == "length"
        if len(tokens) == 3 and len(errors) == 5:
            break
    core.input_queue.put(None)
    t.join(10)
    assert "empty prompt" in errors["empty"][0] and "vocabulary" in errors["oov"][0]
    assert "positive" in errors["zero"][0] and "length limit" in errors["huge"][0]
    assert "already in use" in errors[good.request_id][0]  # the duplicate; the original still finished
    assert len(tokens) == 3


def test_a_killed_worker_fails_every_request_within_a_second():
    core = EngineCore("tiny", executor="multiproc", tp=2, step_delay_s=0.2)
    pids = core.executor.pids
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(ExecutorError, core.run)))
    t.start()
    core.input_queue.put(_spec(0, max_tokens=50))
    core.input_queue.put(_spec(1, max_tokens=50))
    first = core.output_queue.get(timeout=30)
    assert first[0].finish_reason is None
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    failed = {}
    while len(failed) < 2:
        for o in core.output_queue.get(timeout=5):
            if o.finished:
                failed[o.request_id] = (o.finish_reason, o.error)
    assert time.monotonic() - t0 < 1.0
    assert all(r == "engine_dead" and "worker rank 1" in e and "signal 9" in e for r, e in failed.values())
    t.join(15)
    assert not t.is_alive()


class _AnswersOnly(WorkerGroupExecutor):
    """A group of one rank played by the test: it reads the broadcast and writes rank 0's answers over TCP, and
    reports why they ended (``_fail``, as a supervisor or a liveness link does) when the test says."""

    def __init__(self):
        super().__init__(1, "cpu")
        self.rank_bcast = MessageQueue.create_from_handle(self._bcast.export_handle(), 0)
        self.answers = MessageQueue(1, 0, max_chunk_bytes=STEP_CHUNK_BYTES, connect_ip="127.0.0.1")
        self._connect(self.answers.export_handle(), 30)
        self.answers.wait_until_ready(30)

    def _describe(self, rank):
        return f"rank {rank} (node N)"

    def _stop_workers(self):
        self.rank_bcast.close()
        self.answers.close()


@pytest.mark.parametrize("report", ["a moment later", "never"])
def test_rank_0s_answers_ending_before_the_report_of_why_fail_with_that_report(report):
    """A rank 0 cut off: its answers' connection and its liveness link give its node up after the same peer
    timeout, in either order; the error is the link's verdict (rank and node) when it comes within the grace,
    else it names rank 0."""
    ex = _AnswersOnly()
    verdict = "rank 0 (node N): its node did not answer for 3 s; the engine cannot run more steps"
    timer = threading.Timer(0.1, ex._fail, [verdict])
    try:
        ex.answers.shutdown()  # the answers end as a lost connection ends them: the reader raises on its next read
        wait_until(ex._response.readable, what="the end of rank 0's answers seen")
        if report != "never":
            timer.start()
        t0 = time.monotonic()
        with pytest.raises(ExecutorError) as e:
            ex.poll()
        waited = time.monotonic() - t0
        if report != "never":
            assert str(e.value) == verdict and waited < REPORT_GRACE_S
        else:
            assert str(e.value).startswith("rank 0 (node N): its answers stopped: queue "), str(e.value)
            assert waited >= REPORT_GRACE_S - 0.05
    finally:
        timer.cancel()
        if timer.ident is not None:
            timer.join()
        ex.shutdown()


class _EosExecutor(Executor):
    """An executor written against the interface alone: every sampling request draws EOS at once."""

    def __init__(self, config, tp=1, step_delay_s=0.0, device="cpu", answer=None):
        self.answer, self.done, self.steps = answer, Flag(), []
        self.sources = [self.done]

    def submit(self, out):
        self.steps.append([(s.request_id, len(s.token_ids)) for s in out.segments])
        self.in_flight = True
        self.done.set()

    def poll(self):
        if not self.done.is_set():
            return None
        self.done.clear()
        self.in_flight = False
        return [self.answer] * len(self.steps[-1])

    def shutdown(self):
        self.sources = []


def test_an_executor_registered_by_name_serves_the_engine():
    register_executor("eos-test", _EosExecutor)
    assert "eos-test" in executor_names()
    core = EngineCore("tiny", executor="eos-test", executor_options={"answer": tk.EOS})
    assert isinstance(core.executor, _EosExecutor) and core.device == "cpu"
    t = threading.Thread(target=core.run)
    t.start()
    for i in range(3):
        core.input_queue.put(_spec(i))
    outs = []
    while len(outs) < 3:
        outs += [o for o in core.output_queue.get(timeout=30) if o.finished]
    core.input_queue.put(None)
    t.join(30)
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]
    assert all(o.finished and o.finish_reason == "stop" and o.new_token_ids == [tk.EOS] for o in outs)
    assert core.executor.sources == []  # run() shut its executor down
    with pytest.raises(RuntimeError, match="without a step in flight"):
        core.executor.wait(0)


def test_unknown_executors_are_named_and_listed():
    with pytest.raises(ValueError, match=r"executor must be one of \('inprocess', 'multiproc'.*got 'gpu-cluster'"):
        EngineCore("tiny", executor="gpu-cluster")
    with pytest.raises(ValueError, match="runs one rank"):
        EngineCore("tiny", executor="inprocess", tp=2)
    register_executor("missing-module", "hotloop.engine.executors.no_such_module:Nothing")
    with pytest.raises(ValueError, match="'missing-module' cannot be loaded"):
        EngineCore("tiny", executor="missing-module")


# ---- clients and the engine process ----


@pytest.fixture(scope="module")
def client():
    with EngineClient("tiny", max_tokens_per_step=24) as c:
        list(c.generate("warm-up", max_tokens=1))  # both connections accepted: their sockets exist from here on
        yield c


def test_client_streams_the_same_tokens_as_the_core(client, reference):
    for spec in SPECS[:3]:
        outs = list(client.generate(spec.prompt_token_ids, spec.max_tokens, temperature=spec.temperature,
                                    seed=spec.seed))
        assert [t for o in outs for t in o.new_token_ids] == reference[spec.request_id][0]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
    assert tk.decode(tk.encode("héllo", bos=False)) == "héllo"


def test_client_abort_one_all_after_finish_and_leaving_early(client):
    a = client.generate("a", max_tokens=200, request_id="a")
    b = client.generate("b", max_tokens=5, request_id="b")
    next(a)
    client.abort("a")
    rest = list(a)
    assert rest[-1].finish_reason == "abort" and len(rest) < 200
    assert [o.finish_reason for o in b][-1] == "length"
    client.abort("b")  # after finish: ignored
    client.abort("never-sent")
    gens = [client.generate("x", max_tokens=300, request_id=f"all{i}") for i in range(3)]
    for g in gens:
        next(g)
    for i in range(3):
        client.abort(f"all{i}")
    assert all(list(g)[-1].finish_reason == "abort" for g in gens)
    g = client.generate("early", max_tokens=300, request_id="early")
    next(g)
    g.close()  # leaving the iterator aborts the request in the engine
    assert list(client.generate("after", max_tokens=2))[-1].finish_reason == "length"
    with pytest.raises(RequestError, match="empty prompt"):
        list(client.generate([], max_tokens=3))
    with pytest.raises(RequestError, match="already streaming"):
        keep = client.generate("dup", max_tokens=3, request_id="dup")
        client.generate("dup", max_tokens=3, request_id="dup")
    list(keep)


def test_async_client_concurrent_streams_and_engine_death(reference):
    async def main():
        c = await AsyncEngineClient.start("tiny", executor="multiproc", tp=2, max_tokens_per_step=24)
        try:
            async def run(spec):
                return [t async for o in c.generate(spec.prompt_token_ids, spec.max_tokens,
                                                    temperature=spec.temperature, seed=spec.seed)
                        for t in o.new_token_ids]

            got = await asyncio.gather(*(run(s) for s in SPECS))
            stats = await c.stats()
            assert stats.wait_mode == "hotloop" and len(stats.queue_wait_ns) == len(SPECS)
            t0 = None
            with pytest.raises(EngineDeadError, match="signal 9"):
                async for _ in c.generate("long", max_tokens=500):
                    if t0 is None:
                        os.kill(c.engine_pid, signal.SIGKILL)
                        t0 = time.monotonic()
            assert time.monotonic() - t0 < 1.0
            with pytest.raises(EngineDeadError):
                async for _ in c.generate("after", max_tokens=2):
                    pass
            return got
        finally:
            await c.shutdown()

    got = asyncio.run(main())
    assert got == [reference[s.request_id][0] for s in SPECS]


def test_parent_death_reaps_the_engine():
    code = ("from hotloop.engine.client import EngineClient\n"
            "c = EngineClient('tiny', executor='multiproc', tp=1)\n"
            "print(c.engine_pid, flush=True)\n"
            "import time; time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    engine_pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{engine_pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    state = open(f"/proc/{engine_pid}/stat").read().split()[2] if os.path.exists(f"/proc/{engine_pid}") else "gone"
    assert state in ("gone", "Z"), f"the engine outlived its parent (state {state})"
