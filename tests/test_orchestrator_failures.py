"""The orchestrator never hangs: a loop or reader task that dies fails every pending request at once and the
orchestrator reports itself broken; a raising ``on_stats`` callback is logged once and isolated; invalid requests
are refused before anything is sent."""

import asyncio
import logging

import pytest
from conftest import require_torch

require_torch()

from hotloop.engine.protocol import StatsRequest  # noqa: E402
from hotloop.engine.scheduler import RequestError  # noqa: E402
from hotloop.orchestrator import Orchestrator, StageSpec  # noqa: E402

SLOW_LLM = {"model": "tiny", "step_delay_s": 0.02}


def run(coro):
    async def bounded():
        async with asyncio.timeout(120):
            return await coro

    return asyncio.run(bounded())


async def drain(agen):
    return [p async for p in agen]


async def shut(orch):
    replicas = [r for st in orch.stages for r in st.replicas]
    await orch.shutdown()
    assert all(not r.alive for r in replicas)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert pending == [], f"tasks left pending: {pending}"


# (loop, what dies, how the failure is injected)
DEATHS = [
    ("event", "dispatch", "_handle_batch"),
    ("event", "reader", "_put"),
    ("poll", "poll", "_handle_batch"),
]


@pytest.mark.parametrize("loop_kind,victim,method", DEATHS, ids=[d[1] for d in DEATHS])
def test_a_dying_task_fails_every_pending_request_and_breaks_the_orchestrator(loop_kind, victim, method, caplog):
    async def main():
        orch = await Orchestrator.start([StageSpec("llm", replicas=2, options=SLOW_LLM)], loop=loop_kind)
        try:
            streams = [orch.generate(f"p{i}", max_tokens=400, request_id=f"r{i}") for i in range(3)]
            for s in streams:
                await s.__anext__()

            def boom(*args):
                raise RuntimeError(f"injected failure in {method}")

            setattr(orch, method, boom)  # the next batch kills the task that calls it
            for s in streams:
                with pytest.raises(RuntimeError, match=f"injected failure in {method}") as info:
                    await asyncio.wait_for(drain(s), 5)
                assert "broken" in str(info.value)
            assert not orch._requests
            with pytest.raises(RuntimeError, match="broken.*injected failure"):
                await drain(orch.generate("after", max_tokens=2))
        finally:
            await shut(orch)
        assert any("injected failure" in r.getMessage() or (r.exc_info and "injected" in str(r.exc_info[1]))
                   for r in caplog.records if r.name == "hotloop.orchestrator")

    with caplog.at_level(logging.ERROR, logger="hotloop.orchestrator"):
        run(main())


@pytest.mark.parametrize("loop_kind", ["event", "poll"])
def test_a_raising_on_stats_is_logged_once_and_does_not_touch_requests(loop_kind, caplog):
    async def main():
        orch = await Orchestrator.start([StageSpec("llm", options=SLOW_LLM)], loop=loop_kind)
        try:
            calls, three = [], asyncio.Event()

            def on_stats(stage, replica, report):
                calls.append(report)
                if len(calls) == 3:
                    three.set()
                raise ValueError("the stats sink is down")

            orch.on_stats = on_stats
            replica = orch.stages[0].replicas[0]
            running = asyncio.create_task(drain(orch.generate("keep going", max_tokens=20)))
            for _ in range(3):
                replica.submit(StatsRequest())
            await asyncio.wait_for(three.wait(), 5)
            packets = await asyncio.wait_for(running, 10)
            assert packets[-1].finish_reason == "length" and len(packets) == 20
            assert (await asyncio.wait_for(drain(orch.generate("after", max_tokens=3)), 5))[-1].finished
            assert orch.monitor.stats_batches == 3 and orch.monitor.callback_errors == 3
        finally:
            await shut(orch)
        logged = [r for r in caplog.records if r.name == "hotloop.orchestrator" and "on_stats" in r.getMessage()]
        assert len(logged) == 1, [r.getMessage() for r in logged]
        assert "ValueError" in logged[0].getMessage()

    with caplog.at_level(logging.WARNING, logger="hotloop.orchestrator"):
        run(main())


@pytest.mark.parametrize("loop_kind", ["event", "poll"])
def test_invalid_requests_are_refused_before_anything_is_sent(loop_kind):
    async def main():
        orch = await Orchestrator.start([StageSpec("llm", options={"model": "tiny"})], loop=loop_kind)
        try:
            sent = []
            replica = orch.stages[0].replicas[0]
            real = replica.submit
            replica.submit = lambda msg: (sent.append(msg), real(msg))[1]
            try:
                for kw, exc, match in [(dict(temperature=float("nan")), ValueError, "temperature"),
                                       (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids"),
                                       (dict(request_id=5), TypeError, "request_id must be a str"),
                                       (dict(max_tokens=0), ValueError, "max_tokens must be positive"),
                                       (dict(top_k=3), TypeError, "top_k"),
                                       (dict(prompt=[1, 999]), RequestError, "outside the vocabulary")]:
                    prompt = kw.pop("prompt", "hello")
                    with pytest.raises(exc, match=match):
                        await drain(orch.generate(prompt, **{"max_tokens": 3, **kw}))
            finally:
                del replica.submit
            assert sent == [] and not orch._requests and all(v == 0 for v in orch.monitor.inflight.values())
            got = await asyncio.wait_for(drain(orch.generate("hello", max_tokens=3, temperature=1e-45)), 5)
            assert got[-1].finish_reason == "length"
        finally:
            await shut(orch)

    run(main())


def test_a_transform_replica_drops_a_message_it_cannot_decode_and_serves_on():
    from hotloop.orchestrator.replica import Replica
    from hotloop.orchestrator.vocoder import HOP, TransformChunk

    async def main():
        replica = await Replica.start("transform")
        try:
            replica.submit(StatsRequest())  # an engine message: not one a transform stage decodes
            replica.submit(TransformChunk("r", [1, 2, 3], final=True))
            batch = await asyncio.wait_for(replica.read_batch(), 30)
            out = batch.outputs[0]
            assert out.request_id == "r" and out.finished and len(out.frames) == 3 * HOP * 4
            assert replica.alive
        finally:
            await replica.shutdown()

    asyncio.run(main())


def test_a_transform_replica_whose_vocoder_cannot_be_built_says_why():
    from hotloop.errors import EngineDeadError
    from hotloop.orchestrator.replica import Replica

    async def main():
        with pytest.raises(EngineDeadError, match=r"vocoder start-up failed: .*dim"):
            await Replica.start("transform", dim=-1)  # torch.randn refuses a negative size

    asyncio.run(main())
