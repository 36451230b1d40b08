"""The workloads of ``hotloop bench engine``, shared by its rows in this process (engine_bench.py) and its Ray
rows in their cluster's process (engine_ray.py), so every row measures the same thing.

Contract: ``await one_engine(executor, mode, p, progress, device, cpu_of, **engine_kwargs)`` starts one engine
process (model ``MODEL``) with an AsyncEngineClient, warms it up, runs ``p["repeats"]`` rounds of the arrivals,
decode, single and poisson workloads (sized by ``p``), then measures idle CPU, shuts the engine down and returns
``(runs, idle)``: a list of one dict per round ({workload: figures}) and the idle figures. ``cpu_of(engine pid)``
returns a counter: a function giving ({the engine's processes: CPU s}, {other processes: CPU s});
``engine_tree_cpu`` counts the engine's process tree. TTFT is measured at the client (send -> first token).
"""

from __future__ import annotations

import asyncio
import random
import time

from hotloop.bench.proc import process_tree_cpu_seconds
from hotloop.bench.report import Progress, percentile, time_stream

MODEL = "small"


async def _stream(client, prompt_len: int, max_tokens: int, seed: int):
    """Send one request; return (ttft_s, [inter-token gaps s], tokens)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    t0 = time.perf_counter()
    first, gaps, outs = await time_stream(client.generate(prompt, max_tokens, ignore_eos=True), t0)
    return first, gaps, sum(len(out.new_token_ids) for out in outs)


async def _arrivals(client, n: int):
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_stream(client, 128, 8, i) for i in range(n)))
    dt = time.perf_counter() - t0
    ttft = [r[0] for r in res]
    return {"req_per_s": n / dt, "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3}


async def _decode(client, n: int, out_len: int, cpu):
    c0 = sum(cpu()[0].values())
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_stream(client, 32, out_len, 1000 + i) for i in range(n)))
    dt = time.perf_counter() - t0
    tokens = sum(r[2] for r in res)
    return {"tok_per_s": tokens / dt, "cpu_ms_per_token": (sum(cpu()[0].values()) - c0) * 1e3 / tokens}


async def _single(client, out_len: int):
    t0 = time.perf_counter()
    _, _, n = await _stream(client, 32, out_len, 7)
    return {"tok_per_s": n / (time.perf_counter() - t0)}


async def _poisson(client, rate: float, seconds: float):
    await client.stats()  # reset the engine's queue-wait record
    rng = random.Random(11)
    tasks = []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end:
        tasks.append(asyncio.create_task(_stream(client, 32, 32, 2000 + i)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    res = await asyncio.gather(*tasks)
    stats = await client.stats()
    gaps = [g for r in res for g in r[1]]
    qw = stats.queue_wait_ns
    return {"ttft_p99_ms": percentile([r[0] for r in res], 99) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "queue_wait_p50_us": percentile(qw, 50) / 1e3, "queue_wait_p99_us": percentile(qw, 99) / 1e3,
            "requests": len(res), "ttft_ms": [r[0] * 1e3 for r in res], "itl_ms": [g * 1e3 for g in gaps]}


async def _idle(client, seconds: float, cpu):
    await asyncio.sleep(0.2)
    c0, t0 = cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    c1, dt = cpu(), time.monotonic() - t0
    pct = [{k: 100 * (v - before.get(k, 0.0)) / dt for k, v in now.items()} for now, before in zip(c1, c0)]
    return {"idle_cpu_pct": sum(pct[0].values()), "idle_cpu_pct_by_process": pct[0], "idle_cpu_pct_other": pct[1]}


def engine_tree_cpu(pid: int):
    """The CPU counter of an engine whose ranks are its descendants: (the engine's processes, others) -> seconds."""
    return lambda: ({"engine and workers": process_tree_cpu_seconds(pid)}, {})


async def one_engine(executor: str, mode: str, p: dict, progress: Progress, device: str, cpu_of=engine_tree_cpu,
                      **engine_kwargs):
    """`cpu_of(engine pid)`: a function returning ({the engine's processes: CPU s}, {other processes: CPU s})."""
    from hotloop.engine.client import AsyncEngineClient

    client = await AsyncEngineClient.start(MODEL, executor=executor, wait_mode=mode, max_num_seqs=64,
                                           max_tokens_per_step=256, device=device, **engine_kwargs)
    cpu = cpu_of(client.engine_pid)
    try:
        await _single(client, 8)  # warm-up
        runs = []
        for rep in range(p["repeats"]):
            progress.step(f"{executor} {mode} repeat {rep + 1}")
            r = {"arrivals": await _arrivals(client, p["arrivals"]),
                 "decode": await _decode(client, p["decode_n"], p["decode_len"], cpu),
                 "single": await _single(client, p["single_len"]),
                 "poisson": await _poisson(client, p["rate"], p["poisson_s"])}
            runs.append(r)
        idle = await _idle(client, p["idle_s"], cpu)
    finally:
        await client.shutdown()
    return runs, idle
