"""The orchestrator: one scenario matrix, run on the event-driven loop and on the legacy poll loop."""

import asyncio
import os
import signal
import time

import pytest
from conftest import require_torch

require_torch()

from hotloop.engine.scheduler import RequestError  # noqa: E402
from hotloop.orchestrator import Orchestrator, Replica, ReplicaDeadError, StageSpec  # noqa: E402
from hotloop.orchestrator.orchestrator import loop_from_env  # noqa: E402
from hotloop.orchestrator.vocoder import HOP  # noqa: E402

LLM = {"model": "tiny"}


@pytest.fixture(params=["event", "poll"])
def loop_kind(request):
    return request.param


def run(coro):
    async def bounded():
        async with asyncio.timeout(120):  # in the same task: finish() can check that no other task is left
            return await coro

    return asyncio.run(bounded())


async def started(stages, loop_kind):
    orch = await Orchestrator.start(stages, loop=loop_kind)
    assert orch.loop == loop_kind
    return orch


async def finish(orch, loop_kind):
    assert orch.monitor.loop_idle + orch.monitor.loop_active > 0, f"the {loop_kind} loop never turned"
    # the loop that was selected is the one that turned (the other kind's tasks do not exist)
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert ("hotloop-orch-dispatch" in names) == (loop_kind == "event")
    assert ("hotloop-orch-poll" in names) == (loop_kind == "poll")
    replicas = [r for st in orch.stages for r in st.replicas]
    await orch.shutdown()
    assert all(not r.alive for r in replicas)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert pending == [], f"tasks left pending: {pending}"


async def collect(orch, prompt="hello", max_tokens=8, **kw):
    return [p async for p in orch.generate(prompt, max_tokens=max_tokens, **kw)]


def test_loop_selection_from_the_environment():
    for v in ("1", "TRUE", " yes ", "On", None, ""):
        assert loop_from_env(v) == "event"
    for v in ("0", "false", "No", "OFF"):
        assert loop_from_env(v) == "poll"
    with pytest.raises(ValueError, match="1/true/yes/on"):
        loop_from_env("maybe")


def test_two_stage_llm_to_llm(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", options=LLM), StageSpec("llm", options=LLM, max_tokens=5)], loop_kind)
        a = await collect(orch, "two stages", max_tokens=6)
        b = await collect(orch, "two stages", max_tokens=6)
        assert [p.tokens for p in a] == [p.tokens for p in b] and len(a) == 5
        assert [p.finished for p in a] == [False] * 4 + [True] and a[-1].finish_reason == "length"
        await finish(orch, loop_kind)

    run(main())


def test_llm_to_transform_streams_chunks_in_order(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", options=LLM, stream_chunk_tokens=3), StageSpec("transform")],
                             loop_kind)
        packets = await collect(orch, "stream me", max_tokens=10)
        assert [len(p.frames) // 4 for p in packets] == [3 * HOP] * 3 + [1 * HOP]  # chunks of 3 tokens, in order
        assert [p.finished for p in packets] == [False, False, False, True]
        await finish(orch, loop_kind)
        # the same tokens in one whole chunk give the same frames: the chunks came in order
        whole = await started([StageSpec("llm", options=LLM), StageSpec("transform")], loop_kind)
        one = await collect(whole, "stream me", max_tokens=10)
        import numpy as np

        streamed = np.frombuffer(b"".join(p.frames for p in packets), np.float32)
        assert len(one) == 1 and np.allclose(np.frombuffer(one[0].frames, np.float32), streamed, atol=1e-5)
        await finish(whole, loop_kind)

    run(main())


def test_single_stage_transform(loop_kind):
    async def main():
        orch = await started([StageSpec("transform")], loop_kind)
        packets = await collect(orch, [1, 2, 3, 4])
        assert len(packets) == 1 and len(packets[0].frames) == 4 * HOP * 4 and packets[0].finished
        await finish(orch, loop_kind)

    run(main())


def test_abort_reaches_only_the_bound_replica_and_returns_partial_output(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", replicas=2, options={**LLM, "step_delay_s": 0.02})], loop_kind)
        other = asyncio.create_task(collect(orch, "other", max_tokens=30, request_id="other"))
        got = []
        async for p in orch.generate("abort me", max_tokens=500, request_id="victim"):
            got.append(p)
            if len(got) == 3:
                orch.abort("victim")
        assert got[-1].finish_reason == "abort" and len(got) == 4  # three tokens, then the abort
        assert (await other)[-1].finish_reason == "length"  # the other replica's request was not touched
        assert all(v == 0 for v in orch.monitor.inflight.values())
        await finish(orch, loop_kind)

    run(main())


def test_several_replicas_share_the_load(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", replicas=2, options={**LLM, "step_delay_s": 0.01})], loop_kind)
        seen = {}
        orig = Replica.submit

        def spy(self, message):
            seen.setdefault(self.name, []).append(message.request_id)
            return orig(self, message)

        Replica.submit = spy
        try:
            outs = await asyncio.gather(*(collect(orch, f"p{i}", max_tokens=4) for i in range(6)))
        finally:
            Replica.submit = orig
        assert all(o[-1].finished for o in outs)
        assert sorted(len(v) for v in seen.values()) == [3, 3]
        await finish(orch, loop_kind)

    run(main())


def test_stats_only_and_finished_only_batches_are_kept(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", options={**LLM, "step_delay_s": 0.02})], loop_kind)
        stats = []
        orch.on_stats = lambda stage, replica, report: stats.append(report)
        replica = orch.stages[0].replicas[0]
        from hotloop.engine.protocol import StatsRequest

        replica.submit(StatsRequest())  # answered with a batch that carries only stats
        agen = orch.generate("x", max_tokens=400, request_id="fin")
        await agen.__anext__()
        replica.abort("fin")  # the engine answers with a finished id and no tokens
        rest = [p async for p in agen]
        assert rest[-1].finish_reason == "abort"
        deadline = time.monotonic() + 5
        while not stats and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert stats and stats[0].wait_mode == "hotloop"
        assert orch.monitor.stats_batches >= 1 and orch.monitor.finished_only_outputs >= 1
        await finish(orch, loop_kind)

    run(main())


def test_replica_death_evicts_it_fails_only_its_requests_and_the_server_lives(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", replicas=2, options={**LLM, "step_delay_s": 0.02})], loop_kind)
        a = orch.generate("a", max_tokens=300, request_id="a")
        b = orch.generate("b", max_tokens=20, request_id="b")
        first_a = await a.__anext__()
        await b.__anext__()
        victim = [r for r in orch.stages[0].replicas if orch._requests["a"].bound[0] is r][0]
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(ReplicaDeadError, match="failed"):
            async for _ in a:
                pass
        assert time.monotonic() - t0 < 1.0 and first_a.tokens
        assert [p async for p in b][-1].finish_reason == "length"
        assert orch.stages[0].replicas == [r for r in orch.stages[0].replicas if r is not victim]
        assert orch.monitor.evictions == 1
        assert (await collect(orch, "after", max_tokens=3))[-1].finished  # still serving
        last = orch.stages[0].replicas[0]
        c = orch.generate("c", max_tokens=300)
        await c.__anext__()
        os.kill(last.pid, signal.SIGKILL)
        with pytest.raises(ReplicaDeadError):
            async for _ in c:
                pass
        with pytest.raises(ReplicaDeadError, match="no live replica"):
            await collect(orch, "nobody home")
        assert not victim.alive
        await finish(orch, loop_kind)

    run(main())


def test_a_dead_downstream_stage_fails_the_request_not_the_server(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", options=LLM), StageSpec("transform")], loop_kind)
        os.kill(orch.stages[1].replicas[0].pid, signal.SIGKILL)
        with pytest.raises(ReplicaDeadError):
            await collect(orch, "downstream", max_tokens=4)
        await orch.add_replica(1)
        assert (await collect(orch, "again", max_tokens=4))[-1].finished
        await finish(orch, loop_kind)

    run(main())


def test_swapped_and_added_replicas_are_read_at_once(loop_kind, monkeypatch):
    import hotloop.orchestrator.orchestrator as orchestrator_module

    monkeypatch.setattr(orchestrator_module, "RECONCILE_INTERVAL_S", 60)  # the schedule cannot be what helps

    async def main():
        orch = await started([StageSpec("transform")], loop_kind)
        old = orch.stages[0].replicas[0]
        new = await Replica.start("transform", "swapped")
        orch.swap_replica(0, old, new)
        await old.shutdown()
        assert (await asyncio.wait_for(collect(orch, [1, 2]), 5))[-1].finished
        added = await orch.add_replica(0)
        orch.stages[0].replicas.remove(new)  # route the next request to the added one
        orch.stages[0].replicas.insert(0, new)
        orch.monitor.inflight[new.name] = 10
        assert (await asyncio.wait_for(collect(orch, [3]), 5))[-1].finished and added.alive
        orch.monitor.inflight[new.name] = 0
        await finish(orch, loop_kind)

    run(main())


def test_no_duplicate_terminal_output_and_bad_input(loop_kind):
    async def main():
        orch = await started([StageSpec("llm", options=LLM)], loop_kind)
        packets = await collect(orch, "once", max_tokens=5)
        assert sum(p.finished for p in packets) == 1
        with pytest.raises(RequestError, match="empty prompt"):
            await collect(orch, [])
        orch.abort("never-existed")
        await finish(orch, loop_kind)

    run(main())


def test_the_reconcile_schedule_finds_replicas_added_behind_the_api_under_traffic(loop_kind, monkeypatch):
    import hotloop.orchestrator.orchestrator as orchestrator_module

    monkeypatch.setattr(orchestrator_module, "RECONCILE_INTERVAL_S", 0.2)

    async def main():
        orch = await started([StageSpec("transform")], loop_kind)
        stray = await Replica.start("transform", "stray")
        orch.stages[0].replicas.append(stray)  # no add_replica: only the schedule (or the poll scan) can see it

        async def traffic():
            while True:
                await collect(orch, [5, 6])

        busy = asyncio.create_task(traffic())
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and loop_kind == "event" and stray not in orch._readers:
            await asyncio.sleep(0.05)
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        if loop_kind == "event":
            assert stray in orch._readers, "continuous traffic starved the reconcile schedule"
        await finish(orch, loop_kind)

    run(main())


# numpy is not a dependency of hotloop (nor of torch): every stage process of this script finds no numpy (the
# blocker is a sitecustomize module on PYTHONPATH, so the processes the orchestrator spawns load it too).
_NO_NUMPY_SITE = '''
import sys

class _NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoNumpy())
'''

_TRANSFORM_WITHOUT_NUMPY = '''
import asyncio, sys
from hotloop.orchestrator import Orchestrator, StageSpec

async def main():
    orch = await Orchestrator.start([StageSpec("transform")])
    try:
        packets = [p async for p in orch.generate([1, 2, 3, 4])]
    finally:
        await orch.shutdown()
    assert "numpy" not in sys.modules
    (p,) = packets
    assert p.finished and p.error is None, p
    sys.stdout.write(p.frames.hex())

asyncio.run(main())
'''


def test_the_transform_stage_runs_without_numpy(tmp_path):
    """A plain install (`pip install torch==2.13.0 .`) has no numpy: the transform stage must not need it."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_NO_NUMPY_SITE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    check = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True, text=True)
    assert "hidden by the test" in check.stderr, "the numpy blocker is not loaded"
    out = subprocess.run([sys.executable, "-c", _TRANSFORM_WITHOUT_NUMPY], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    frames = bytes.fromhex(out.stdout)
    import torch
    from hotloop.orchestrator.vocoder import Vocoder

    assert frames == Vocoder()([1, 2, 3, 4])  # the same samples as here, in-process
    samples = torch.frombuffer(bytearray(frames), dtype=torch.float32)
    v = Vocoder()
    expected = torch.tanh(v.embed[torch.tensor([1, 2, 3, 4])] @ v.w).reshape(-1)
    assert samples.shape == (4 * HOP,) and torch.allclose(samples, expected)
