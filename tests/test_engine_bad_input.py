"""Bad input cannot hurt the engine: clients reject invalid requests before sending them (and stay usable); the
engine re-validates what it decodes, answers undecodable requests with an error when their id can be recovered,
and fails a request whose parameters break sampling without touching the others, with either executor."""

import asyncio
import math
import threading

import pytest
from conftest import require_torch

require_torch()

import msgspec  # noqa: E402

from hotloop.engine import AddRequest, EngineCore  # noqa: E402
from hotloop.engine import tokenizer as tk  # noqa: E402
from hotloop.engine.client import AsyncEngineClient, EngineClient  # noqa: E402
from hotloop.engine.protocol import encoder  # noqa: E402


PROMPT = tk.encode("bad input")

# (generate kwargs, exception type, what the message says)
INVALID = [
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature="hot"), TypeError, "temperature must be a real number"),
    (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids must be integers"),
    (dict(stop_token_ids=[tk.VOCAB_SIZE]), ValueError, "stop_token_ids"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a sequence"),
    (dict(request_id=5), TypeError, "request_id must be a str"),
    (dict(max_tokens=0), ValueError, "max_tokens must be positive"),
    (dict(max_tokens=2.5), TypeError, "max_tokens must be an integer"),
    (dict(max_tokens=10**6), ValueError, "length limit"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
    (dict(seed=1 << 70), ValueError, "seed must fit"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos must be a bool"),
    (dict(prompt=[1, 2.5]), TypeError, "prompt token ids must be integers"),
    (dict(prompt=[1, -1]), ValueError, "outside the vocabulary"),
    (dict(prompt=[True]), TypeError, "prompt token ids must be integers"),
    (dict(prompt=[]), ValueError, "empty prompt"),
    (dict(prompt=None), TypeError, "prompt must be a str or a sequence of token ids"),
]


def _call(kwargs):
    kw = dict(kwargs)
    prompt = kw.pop("prompt", PROMPT)
    kw.setdefault("max_tokens", 4)
    return prompt, kw


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_client_rejects_invalid_requests_before_sending_and_stays_usable():
    with EngineClient("tiny") as c:
        expected = _tokens(c.generate(PROMPT, max_tokens=4, temperature=0.7, seed=3))
        sent = []
        real_send = c._engine.send
        c._engine.send = lambda msg: (sent.append(msg), real_send(msg))[1]
        try:
            for kwargs, exc, match in INVALID:
                prompt, kw = _call(kwargs)
                with pytest.raises(exc, match=match):
                    c.generate(prompt, **kw)
        finally:
            del c._engine.send  # no reference cycle keeps the engine's handles open past the test
        assert sent == [], f"invalid requests were sent: {sent}"
        assert not c._core.streams
        # numpy-like integers and tiny positive temperatures are fine; the client still serves
        assert _tokens(c.generate(PROMPT, max_tokens=4, temperature=0.7, seed=3, request_id="again")) == expected
        greedy = _tokens(c.generate(PROMPT, max_tokens=4))
        assert _tokens(c.generate(PROMPT, max_tokens=4, temperature=1e-45)) == greedy


def test_async_client_rejects_invalid_requests_before_sending_and_stays_usable():
    async def main():
        c = await AsyncEngineClient.start("tiny")
        try:
            sent = []
            real_send = c._engine.send
            c._engine.send = lambda msg: (sent.append(msg), real_send(msg))[1]
            try:
                for kwargs, exc, match in INVALID:
                    prompt, kw = _call(kwargs)
                    with pytest.raises(exc, match=match):
                        async for _ in c.generate(prompt, **kw):
                            pass
            finally:
                del c._engine.send
            assert sent == [] and not c._core.streams
            outs = [o async for o in c.generate(PROMPT, max_tokens=3)]
            assert outs[-1].finish_reason == "length"
        finally:
            await c.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def _run_core(core, specs, timeout=30):
    """Feed specs to a running core; return {id: (tokens, finish_reason, error)} once every one finished."""
    for spec in specs:
        core.input_queue.put(spec)
    got, done = {}, set()
    want = {s.request_id for s in specs}
    while not want <= done:
        for o in core.output_queue.get(timeout=timeout):
            toks, _, _ = got.get(o.request_id, ([], None, None))
            got[o.request_id] = (toks + o.new_token_ids, o.finish_reason, o.error)
            if o.finished:
                done.add(o.request_id)
    return got


@pytest.mark.parametrize("executor", ["inprocess", "multiproc"])
def test_bad_sampling_parameters_fail_only_their_request(executor):
    core = EngineCore("tiny", executor=executor)
    t = threading.Thread(target=core.run)
    t.start()
    try:
        good = lambda rid, **kw: AddRequest(rid, PROMPT, 6, temperature=0.8, seed=7, **kw)  # noqa: E731
        before = _run_core(core, [good("before"), AddRequest("greedy", PROMPT, 6)])
        # requests built by hand bypass the clients' checks: the engine checks them again
        bad = [AddRequest("nan", PROMPT, 6, temperature=float("nan")),
               AddRequest("inf", PROMPT, 6, temperature=float("inf")),
               AddRequest("neg", PROMPT, 6, temperature=-1.0),
               AddRequest("stop-float", PROMPT, 6, stop_token_ids=[1.5]),
               AddRequest("stop-oov", PROMPT, 6, stop_token_ids=[10**6]),
               AddRequest("prompt-float", [1, 2.5], 6),
               AddRequest("tokens-str", "abc", 6),
               AddRequest("seed-float", PROMPT, 6, seed=0.5),
               AddRequest("eos-int", PROMPT, 6, ignore_eos=3)]
        tiny = AddRequest("tiny", PROMPT, 6, temperature=1e-45)  # below the greedy threshold: argmax
        got = _run_core(core, [*bad, tiny, good("after")])
        for spec in bad:
            toks, reason, error = got[spec.request_id]
            assert reason == "error" and error and spec.request_id in error and toks == [], (spec, got[spec.request_id])
        assert "temperature" in got["nan"][2] and "stop_token_ids" in got["stop-float"][2]
        assert got["tiny"][0] == before["greedy"][0] and got["tiny"][1] == "length"
        assert got["after"][:2] == before["before"][:2] and got["after"][1] == "length"
    finally:
        core.input_queue.put(None)
        t.join(30)
    assert not t.is_alive()


def test_a_sampling_error_fails_only_the_request_that_caused_it(monkeypatch):
    """A draw that raises (here: forced for one seed) is that request's error, not the executor's."""
    import hotloop.engine.model as model

    real = model._draw

    def draw(row, s):
        if s.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(row, s)

    monkeypatch.setattr(model, "_draw", draw)
    core = EngineCore("tiny")
    t = threading.Thread(target=core.run)
    t.start()
    try:
        got = _run_core(core, [AddRequest("cursed", PROMPT, 5, temperature=1.0, seed=666),
                               AddRequest("fine", PROMPT, 5, temperature=1.0, seed=1)])
        assert got["cursed"][1] == "error" and "sampling failed" in got["cursed"][2] and "inf, nan" in got["cursed"][2]
        assert got["fine"][1] == "length" and len(got["fine"][0]) == 5
        assert _run_core(core, [AddRequest("later", PROMPT, 3)])["later"][1] == "length"
    finally:
        core.input_queue.put(None)
        t.join(30)


@pytest.mark.parametrize("executor", ["inprocess", "multiproc"])
def test_the_engine_process_answers_bad_and_undecodable_messages_and_keeps_serving(executor):
    async def main():
        c = await AsyncEngineClient.start("tiny", executor=executor)
        try:
            reference = [o async for o in c.generate(PROMPT, max_tokens=5, temperature=0.9, seed=11)]
            pid = c.engine_pid

            async def answer(rid, data):
                """Send raw bytes as if a client skipped validation; the engine's answer for `rid`."""
                q = asyncio.Queue()
                c._core.streams[rid] = q.put_nowait
                try:
                    c._engine.requests.send(data)
                    return await asyncio.wait_for(q.get(), 5)
                finally:
                    del c._core.streams[rid]

            raw = {
                "nan": encoder.encode(AddRequest("nan", PROMPT, 5, temperature=float("nan"))),
                "tiny": encoder.encode(AddRequest("tiny", PROMPT, 5, temperature=1e-45)),
                "stop-float": encoder.encode(AddRequest("stop-float", PROMPT, 5, stop_token_ids=[1.5])),
                "prompt-str": msgspec.msgpack.encode(["add", "prompt-str", "hello", 5]),
                "max-str": msgspec.msgpack.encode(["add", "max-str", PROMPT, "5"]),
            }
            for rid, data in raw.items():
                out = await answer(rid, data)
                if rid == "tiny":
                    assert out.error is None and out.new_token_ids  # greedy, served
                    continue
                assert out.finished and out.finish_reason == "error" and rid in out.error, (rid, out)
            assert "temperature" in (await answer("nan", raw["nan"])).error  # the id is free again
            # no recoverable id: logged and dropped; the engine serves on
            for data in (b"\xc1\xc1 not msgpack", msgspec.msgpack.encode(["add", 5, PROMPT, 5]),
                         msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode(["abort", [1, 2]])):
                c._engine.requests.send(data)
            after = [o async for o in c.generate(PROMPT, max_tokens=5, temperature=0.9, seed=11)]
            assert _tokens(after) == _tokens(reference) and after[-1].finish_reason == "length"
            assert c.engine_pid == pid and c._engine.proc.exitcode is None
        finally:
            await c.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_core_drops_requests_without_a_string_id_and_serves_on(caplog):
    core = EngineCore("tiny")
    t = threading.Thread(target=core.run)
    t.start()
    try:
        with caplog.at_level("ERROR", logger="hotloop.engine"):
            core.input_queue.put(AddRequest(5, PROMPT, 3))
            got = _run_core(core, [AddRequest("ok", PROMPT, 3)])
        assert got["ok"][1] == "length"
        assert any("request_id" in r.getMessage() for r in caplog.records)
    finally:
        core.input_queue.put(None)
        t.join(30)


def test_sample_treats_tiny_temperatures_as_greedy_and_never_raises_for_bad_ones():
    import torch

    from hotloop.engine.model import GREEDY_TEMPERATURE, Segment, SampleError, sample

    logits = torch.tensor([[0.0, 5.0, 1.0]] * 5)
    segs = [Segment(str(i), [1], 0, 4, True, temp, 0)
            for i, temp in enumerate([1e-45, GREEDY_TEMPERATURE / 2, float("nan"), float("inf"), -1.0])]
    out = sample(logits, segs)
    assert out[:2] == [1, 1]
    assert all(isinstance(o, SampleError) and "temperature" in str(o) for o in out[2:])
    assert math.isclose(GREEDY_TEMPERATURE, 1e-5)
