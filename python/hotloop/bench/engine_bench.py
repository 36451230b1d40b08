"""``hotloop bench engine``: the engine's three wait modes side by side, with both executors, in one run.

Each (executor, mode) pair gets its own engine process (model preset "small", a few ms per batched step here)
driven by an AsyncEngineClient with the same workloads, repeated; figures are medians over repeats:

- arrivals: many requests (prompt 128 / output 8) sent at once: requests/s, TTFT p50 / p99;
- decode: many concurrent requests (32 / 64 quick, 32 / 256 full): output tokens/s;
- single: one request (32 / 64 or 256): tokens/s;
- poisson: arrivals at a fixed rate (32 / 32): TTFT p99 and inter-token latency p99;
- queue wait: the engine's own record, input thread receive -> scheduler, over the poisson workload (requests
  arrive while steps run);
- idle: engine process CPU (its workers included) while nothing is sent;
- CPU per token: engine + worker CPU seconds over the decode workload / tokens generated.

Ray rows (``engine_ray.py``, when Ray is installed and a loopback-only network namespace can be made): tp=2 on a
simulated two-node Ray cluster, both ranks on one node and rank 1 on the second node, next to multiproc tp=2.

Method notes: TTFT is measured at the client (send -> first token received); CPU from /proc (utime + stime).

Device: the engines run the model on ``device`` (``run(device=...)``; the CLI takes ``$HOTLOOP_BENCH_DEVICE``,
default "cpu"; ``benchmarks/gpu_check.sh`` runs it with "cuda"). On CUDA the in-process executor launches each step
from the engine thread and its completion comes from hotloop.cuda.StepNotifier (the engine loop waits on it in
hotloop mode); the multi-process executor's rank 0 waits on its own notifier before answering.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time

from hotloop.bench.report import (NO_PLOT, Progress, Report, cdf_panel, fmt, percentile, process_tree_cpu_seconds,
                                   pyplot, table, time_stream)

MODES = ("block", "poll", "hotloop")
EXECUTORS = ("inprocess", "multiproc")
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


async def _one_engine(executor: str, mode: str, p: dict, progress: Progress, device: str, cpu_of=engine_tree_cpu,
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


def _med(runs, part, key):
    vals = [r[part][key] for r in runs]
    return statistics.median(vals), (max(vals) - min(vals)) / 2 if len(vals) > 1 else float("nan")


def _plot(results: dict, path: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_PLOT
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = ((axes[0], "ttft_ms", "time to first token (poisson arrivals)", "fraction of requests"),
              (axes[1], "itl_ms", "inter-token latency (poisson arrivals)", "fraction of gaps"))
    for ax, key, title, ylabel in panels:
        cdf_panel(ax, {f"{executor} / {mode}": [x for r in runs for x in r["poisson"][key]]
                       for (executor, mode), (runs, _) in results.items()}, title, ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"latency distributions plotted to {path}"


def _ray_note(results: dict, missing: str | None) -> str:
    if missing:
        return f"No ray rows: {missing}."
    idle = {label: i for (label, _), (_, i) in results.items() if label.startswith("ray")}
    worst = {label: max(i["idle_cpu_pct_by_process"].values()) for label, i in idle.items()}
    daemons = {label: i["idle_cpu_pct_other"]["ray daemons"] for label, i in idle.items()}
    return ("ray rows: tp=2 on a simulated two-node Ray cluster in a loopback-only network namespace, hotloop "
            "mode, next to multiproc tp=2 run there, every rank with one torch thread (what Ray gives an actor of one "
            "CPU); their CPU and idle CPU count the engine process and the rank "
            "processes (idle CPU of the busiest one: " + ", ".join(f"{k} {fmt(v, 3)} %" for k, v in worst.items())
            + "); Ray's own daemons apart, idle: " + ", ".join(f"{k} {fmt(v, 2)} %" for k, v in daemons.items())
            + ".")


def run(quick: bool = False, plot_path: str | None = "hotloop-bench-engine.png", device: str | None = None):
    from hotloop.engine.device import resolve_device

    device = resolve_device(device or os.environ.get("HOTLOOP_BENCH_DEVICE", "cpu"))  # a clear error up front
    p = (dict(repeats=1, arrivals=16, decode_n=8, decode_len=32, single_len=32, rate=8.0, poisson_s=2.0, idle_s=2.0)
         if quick else
         dict(repeats=3, arrivals=32, decode_n=16, decode_len=256, single_len=256, rate=10.0, poisson_s=5.0,
              idle_s=5.0))
    progress = Progress("bench engine", len(EXECUTORS) * len(MODES) * p["repeats"])
    results = {}
    for executor in EXECUTORS:
        for mode in MODES:
            results[(executor, mode)] = asyncio.run(_one_engine(executor, mode, p, progress, device))
    progress.close()
    from hotloop.bench import engine_ray  # imports nothing of Ray until the rows run, in their own process

    ray_missing = engine_ray.unavailable(device)
    if ray_missing is None:
        results.update(engine_ray.results(p))

    rows, data = [], {}
    for (executor, mode), (runs, idle) in results.items():
        m = {
            "arrivals_req_per_s": _med(runs, "arrivals", "req_per_s"),
            "arrivals_ttft_p50_ms": _med(runs, "arrivals", "ttft_p50_ms"),
            "arrivals_ttft_p99_ms": _med(runs, "arrivals", "ttft_p99_ms"),
            "decode_tok_per_s": _med(runs, "decode", "tok_per_s"),
            "single_tok_per_s": _med(runs, "single", "tok_per_s"),
            "poisson_ttft_p99_ms": _med(runs, "poisson", "ttft_p99_ms"),
            "poisson_itl_p99_ms": _med(runs, "poisson", "itl_p99_ms"),
            "queue_wait_p50_us": _med(runs, "poisson", "queue_wait_p50_us"),
            "queue_wait_p99_us": _med(runs, "poisson", "queue_wait_p99_us"),
            "cpu_ms_per_token": _med(runs, "decode", "cpu_ms_per_token"),
        }
        data[f"{executor}/{mode}"] = {**{k: v[0] for k, v in m.items()}, **{k + "_spread": v[1] for k, v in m.items()},
                                      **{k: v for k, v in idle.items() if k.startswith("idle_")}, "device": device}
        rows.append([f"{executor} / {mode}", *(fmt(m[k][0], 2 if "tok" not in k else 0) for k in (
            "arrivals_req_per_s", "arrivals_ttft_p50_ms", "arrivals_ttft_p99_ms", "decode_tok_per_s",
            "single_tok_per_s", "poisson_ttft_p99_ms", "poisson_itl_p99_ms", "queue_wait_p50_us",
            "queue_wait_p99_us", "cpu_ms_per_token")), fmt(idle["idle_cpu_pct"], 3)])
    reps = p["repeats"]
    text = Report([table(
        f"engine A/B, model '{MODEL}' on {device}, medians over {reps} repeat{'s' * (reps > 1)} "
        f"(arrivals {p['arrivals']} x 128/8; decode {p['decode_n']} x 32/{p['decode_len']}; single 32/"
        f"{p['single_len']}; poisson {p['rate']:g} req/s for {p['poisson_s']:g} s, 32/32; idle {p['idle_s']:g} s)",
        ["executor / mode", "arr req/s", "TTFT p50 ms", "TTFT p99 ms", "decode tok/s", "single tok/s",
         "pois TTFT p99", "ITL p99 ms", "qwait p50 us", "qwait p99 us", "CPU ms/tok", "idle CPU %"],
        rows,
        note="qwait: input thread receive -> scheduler (engine record, poisson workload). CPU: engine process and "
             "its workers. In-process steps complete through a step notifier in every mode (block: notifier.wait, "
             "GIL released; poll: done() in a Python loop; hotloop: wait_any on until(token) and the inputs). "
             "Noise: the *_spread fields of --json give half the range over repeats. "
             + _ray_note(results, ray_missing),
    )])
    if plot_path:
        text.append(_plot(results, plot_path))
    data["goals"] = []  # figures side by side; no goal is stated for them
    return data, text
