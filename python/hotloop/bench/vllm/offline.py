"""``hotloop bench vllm``: vLLM's own engine (AsyncLLM, MultiprocExecutor) in three arms, in the same run and the
same process layout: vLLM's queue and loop ("vllm"), hotloop's queue under vLLM's loop ("hotloop"), hotloop's queue
and engine-core loop ("hotloop+loop", ``hotloop.vllm.engine_loop``).

Method: each engine runs in a fresh driver process (``python -m hotloop.bench.vllm.offline --shapes-driver``) on a
tiny random Llama model built locally (``hotloop.vllm.tiny_model``), with ``HOTLOOP_VLLM`` / ``HOTLOOP_VLLM_LOOP``
set per arm (the driver asks each worker which queue class it runs and the bench checks it) and
``HOTLOOP_VLLM_TIMELINE=1`` in every arm (``hotloop.vllm.timeline``: per-hop stamps). After a warm-up the engine
runs the shapes of the upstream change that handles inputs during a step, scaled to this machine (``shapes()``):
"arrivals" (many short requests: 128 prompt / 8 output tokens at 40 req/s), "poisson" (4 req/s, 32 output
tokens), "decode" (16 requests of 256 tokens at once) and "single" (one request of 256 tokens); greedy, random
prompt token ids (seeded). Per shape: req/s and tok/s (first submit to last completion), time to first token and
inter-token latency (gaps between streamed outputs) p50 / p99, the engine core's queue wait (input thread to
scheduler) p50 / p99, CPU seconds of the whole process tree per 1000 output tokens, and each request's time to
first token split into hops. After the last shape the tree's idle CPU over 3 s (every thread's schedstat; torch's
gloo loop threads apart). A round runs one engine per TP and arm, the arm that goes first rotating each round;
each cell is the median (min-max) over rounds and each ratio is taken within a round. Greedy token ids are
compared across arms and rounds per shape.

``--device sim``: the model's forward on the simulated device (``hotloop.vllm.sim_device``: vLLM's host work real,
each forward a modelled device time off the CPU, 1.3 ms + 2 us a token by default, TP ranks ending a step
together), in the upstream shapes' token counts (``shapes(quick, "sim")``), at TP 1, 2 and 4 (OpenMP threads bound
``0``, ``0|1``, ``0|1|0|1``; the tiny model four heads wide), with a fourth arm, vLLM's queue with its spinloop
extension (``VLLM_USE_SPINLOOP_EXT=1``). Per shape it adds the host CPU of each process (front end, engine core,
each worker: every thread's schedstat over the shape's span, percent of one core). ``--online`` runs the same
shapes through vLLM's own server and client instead (``online.py``). ``--arms`` picks arms (vLLM's first),
``hotloop-plain`` among them (hotloop's queue with its readers' plain wait, ``HOTLOOP_VLLM_PACED=0``).

The arms, the shapes and what compares them are in ``arms``; the CPU of the engine's processes in ``processes``;
``driver.Driver`` is the offline ``LLM.generate`` harness the vLLM tests and the batch rows use.

On this machine (few cores) TP=2 binds the workers' OpenMP threads one core each (``VLLM_CPU_OMP_THREADS_BIND``
"0|1"), TP=1 to core 0; the KV cache is 1 GiB (``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time

from hotloop.bench import host_samples
from hotloop.bench.proc import process_tree_cpu_seconds, tree
from hotloop.bench.report import (NO_PLOT, Progress, Report, cdf_panel, fmt, goal_lines, median, median_range,
                                   over_rounds, percentile, pyplot, table)
from hotloop.bench.vllm import batch
from hotloop.bench.vllm.arms import (ARMS, EXTRA_ARMS, SIM_ARMS, Shape, arm_env, arms_for, chain_delta,
                                     check_queue_class, compare_outputs, cpu_rows, identical_goal, shapes, sim_spec,
                                     read_cpu_delta, worker_queue_class, worker_read_cpu, worker_reader_chains,
                                     worker_sim_device)
from hotloop.bench.vllm.online import run as run_online
from hotloop.bench.vllm.processes import IDLE_PARTS, cpu_by_process, idle_cpu, process_kind
from hotloop.testing import cpu_cgroup
from hotloop.vllm.chained_reads import merged


def _prompt_ids(n: int, length: int, seed: int) -> list[list[int]]:
    from hotloop.vllm.tiny_model import CONFIG

    rng = random.Random(seed)
    return [[rng.randrange(4, CONFIG["vocab_size"]) for _ in range(length)] for _ in range(n)]


async def _one_request(engine, prompt, params, rid, at, t_start):
    """One request of a shape, sent `at` s after `t_start`: its submit, first and last token times, the gaps
    between tokens, its token ids."""
    import asyncio

    from vllm.inputs import TokensPrompt

    await asyncio.sleep(max(0.0, t_start + at - time.monotonic()))
    submitted, first, last, gaps, ids = time.monotonic_ns(), None, None, [], []
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
        now = time.monotonic_ns()
        if first is None:
            first = now
        else:
            gaps.append((now - last) / 1e6)
        last, ids = now, out.outputs[0].token_ids
    return {"rid": rid, "submitted": submitted, "first": first, "done": last, "gaps": gaps, "ids": list(ids)}


async def _run_shape(engine, shape: Shape, seed: int) -> dict:
    """Every request of one shape through the engine: its figures, its CPU by process, its hops."""
    import asyncio

    from vllm import SamplingParams

    from hotloop.vllm import timeline

    params = SamplingParams(temperature=0.0, max_tokens=shape.output_tokens, ignore_eos=True)
    prompts = _prompt_ids(shape.n, shape.prompt_tokens, seed)
    timeline.install()  # the front end's client, where it was loaded after the plugin ran in this process
    timeline.front_end_sends()  # forget what came before
    core0 = await engine.engine_core.call_utility_async("hotloop_timeline")  # forget what came before
    await engine.collective_rpc("hotloop_timeline")
    worker_chains0 = await engine.collective_rpc(worker_reader_chains)
    worker_reads0 = await engine.collective_rpc(worker_read_cpu)
    group = os.environ.get(cpu_cgroup.ENV)  # the pod regime: this driver's processes share a CPU quota
    g0 = cpu_cgroup.cpu_stat(group) if group else None
    c0, t_start = process_tree_cpu_seconds(os.getpid()), time.monotonic()
    k0 = cpu_by_process(os.getpid())
    res = await asyncio.gather(*(_one_request(engine, p, params, f"{shape.name}{i}", at, t_start)
                                 for i, (p, at) in enumerate(zip(prompts, shape.arrivals(seed)))))
    span = time.monotonic() - t_start
    cpu = process_tree_cpu_seconds(os.getpid()) - c0
    k1 = cpu_by_process(os.getpid())
    throttled = cpu_cgroup.stat_delta(g0, cpu_cgroup.cpu_stat(group)) if group else None
    cpu_pct = {k: 100.0 * (k1[k] - k0.get(k, 0.0)) / span for k in k1}
    cpu_pct["engine_core+workers"] = sum(v for k, v in cpu_pct.items() if k == "engine_core" or
                                         k.startswith("worker"))
    core = await engine.engine_core.call_utility_async("hotloop_timeline")
    worker = (await engine.collective_rpc("hotloop_timeline"))[0]
    worker_chains1 = await engine.collective_rpc(worker_reader_chains)
    worker_chains = [chain_delta(b, a) for b, a in zip(worker_chains0, worker_chains1)]
    chains = {"engine_core": chain_delta(core0["reader_chains"], core["reader_chains"]),
              "workers": merged(worker_chains)}
    worker_reads = [read_cpu_delta(b, a) for b, a in zip(worker_reads0, await engine.collective_rpc(worker_read_cpu))]
    reads = {"engine_core": read_cpu_delta(core0["read_cpu"], core["read_cpu"]),
             **{f"worker{i}": r for i, r in enumerate(worker_reads)}}
    wall = (max(r["done"] for r in res) - min(r["submitted"] for r in res)) / 1e9
    tokens = sum(len(r["ids"]) for r in res)
    ttft = [(r["first"] - r["submitted"]) / 1e6 for r in res]
    itl = [g for r in res for g in r["gaps"]]
    waits = [(v[1] - v[0]) / 1e3 for v in core["requests"].values()]
    handoffs = [(v[1] - v[3]) / 1e3 for v in core["requests"].values()]
    hops = timeline.hops({r["rid"]: [r["submitted"], r["first"]] for r in res}, core, worker,
                         timeline.front_end_sends())
    return {"tok_per_s": tokens / wall, "req_per_s": len(res) / wall, "cpu_s_per_1k_tok": 1000 * cpu / tokens,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "queue_wait_p50_us": percentile(waits, 50), "queue_wait_p99_us": percentile(waits, 99),
            "handoff_p50_us": percentile(handoffs, 50),
            "waits_during_step": sum(v[2] for v in core["requests"].values()),
            "hops_ms": {h: median(v) for h, v in hops.items()}, "hops_n": len(hops["time to first token"]),
            "cpu_pct": cpu_pct, "host_cpu_pct": cpu_pct["engine_core+workers"], "cgroup": throttled, "chains": chains,
            "read_cpu": reads if all(reads.values()) else None, "tokens": tokens,
            "ttft_ms": ttft, "itl_ms": itl, "token_ids": [r["ids"] for r in res]}


# the sampled repetition of the decode shape: py-spy's window, whole seconds (HOTLOOP_BENCH_SAMPLE_S: more samples
# for a process's top frames, which the JSON record keeps: top_waiting and top_work, the innermost frames)
SAMPLE_S = int(os.environ.get("HOTLOOP_BENCH_SAMPLE_S", "3"))
SAMPLE_HZ = 100


async def _sampled_decode(engine, shape: Shape, seed: int) -> dict:
    """Where the host CPU goes while decoding, by sampling (bench/host_samples.py): py-spy on the front end, the
    engine core and each worker for SAMPLE_S s while the decode shape runs again and again (a repetition of its
    own: py-spy takes CPU of these two cores, so the timed run above is not the one sampled). Per process: the
    waiting share of its samples, its waiting and work CPU and its measured CPU (percent of a core), the
    sampler's check; the workers' output copy threads (async scheduling) apart."""
    import asyncio

    from vllm import SamplingParams

    me = os.getpid()
    found = tree(me)
    kind = {p: process_kind(p, c, me) for p, c in found.items()}
    workers = sorted(p for p, k in kind.items() if k == "worker")
    pids = {"front_end": me, "engine_core": next(p for p, k in kind.items() if k == "engine_core"),
            **{f"worker{i}": p for i, p in enumerate(workers)}}
    params = SamplingParams(temperature=0.0, max_tokens=shape.output_tokens, ignore_eos=True)
    prompts = _prompt_ids(shape.n, shape.prompt_tokens, seed)
    sampler = await asyncio.to_thread(host_samples.Sampler(pids, SAMPLE_S, SAMPLE_HZ, top=8).start)
    done = asyncio.ensure_future(asyncio.to_thread(sampler.wait))
    rep = 0
    while not done.done():
        rep += 1
        await asyncio.gather(*(_one_request(engine, p, params, f"sampled{rep}-{i}", 0.0, time.monotonic())
                               for i, p in enumerate(prompts)))
    got = await done
    out = {}
    for name, r in got.items():
        copy = [t for t in r["threads"].values() if t.get("name") == "WorkerAsyncOutputCopy"]
        out[name] = {"waiting_share": r["waiting_share"], "waiting_cpu_pct": r["waiting_cpu_pct"],
                     "work_cpu_pct": r["work_cpu_pct"], "measured_cpu_pct": r["measured_cpu_pct"],
                     "check": r["check"], "top_waiting": r["top_waiting"][:3], "top_work": r["top_work"][:8],
                     "output_thread_waiting_cpu_pct": sum(t["waiting_cpu_pct"] for t in copy)}
    return out


def _shapes_driver(args) -> int:
    """One AsyncLLM engine of one arm: every shape in turn, then its idle CPU; one JSON line on stdout."""
    import asyncio

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep the protocol channel clean
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend="mp", dtype="float32",
            max_model_len=512, max_num_seqs=16, seed=0, enforce_eager=True,
            async_scheduling=False if args.sync else None))  # None: vLLM's choice (on a GPU / sim device: on)
        try:
            queue_class = sorted(set(await engine.collective_rpc(worker_queue_class)))
            sim_device = await engine.collective_rpc(worker_sim_device)
            warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            await asyncio.gather(*(_one_request(engine, p, warm, f"warm{i}", 0.0, time.monotonic())
                                   for i, p in enumerate(_prompt_ids(4, 128, 99))))
            out = {"queue_class": queue_class, "sim_device": sim_device}
            for shape in shapes(args.quick, args.device):
                out[shape.name] = await _run_shape(engine, shape, args.seed)
            if args.device == "sim" and os.environ.get("HOTLOOP_BENCH_SAMPLE", "1") != "0":
                decode = next(s for s in shapes(args.quick, args.device) if s.name == "decode")
                out["sampled"] = await _sampled_decode(engine, decode, args.seed)
            out["idle_pct"] = idle_cpu(os.getpid())[0]
            if os.environ.get(cpu_cgroup.ENV):  # the pod regime: every process of the engine in the cgroup
                inside = cpu_cgroup.members(os.environ[cpu_cgroup.ENV])
                out["outside_cgroup"] = sorted(f"{process_kind(p, c, os.getpid())} {p}"
                                               for p, c in tree(os.getpid()).items() if p not in inside)
        finally:
            engine.shutdown()
        proto.write(json.dumps(out) + "\n")

    asyncio.run(main())
    return 0


def run_engine(tp: int, arm: str, model: str, quick: bool, seed: int, device: str = "cpu", sync: bool = False) -> dict:
    """One fresh engine of `arm` through every shape, in a driver process: its figures. A failed driver's error
    carries the last lines of its log (all of it on stderr with HOTLOOP_BENCH_VERBOSE=1)."""
    import tempfile

    verbose = bool(os.environ.get("HOTLOOP_BENCH_VERBOSE"))
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.run(cpu_cgroup.contained([sys.executable, "-m", "hotloop.bench.vllm.offline",
                                                 "--shapes-driver", "--tp", str(tp), "--model", model, "--seed",
                                                 str(seed), "--device", device] + ["--quick"] * quick
                                                + ["--sync"] * sync),
                           env=arm_env(tp, arm, device), stdout=subprocess.PIPE, stderr=None if verbose else log,
                           text=True, timeout=1800, start_new_session=True)
        if p.returncode != 0 or not p.stdout.strip():
            log.seek(0)
            tail = "".join([ln for ln in log.readlines() if "WARNING" not in ln][-25:])
            raise RuntimeError(f"vLLM driver TP={tp} arm {arm} failed (code {p.returncode}); the end of its log "
                               f"(HOTLOOP_BENCH_VERBOSE=1: all of it):\n{tail}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    check_queue_class(arm, res.pop("queue_class"))
    outside = res.pop("outside_cgroup", None)
    if outside:
        raise RuntimeError(f"TP={tp} arm {arm}: processes of the engine ran outside the CPU-limited cgroup: {outside}")
    sim = res.pop("sim_device")
    if (device == "sim") != all(sim) or (device == "sim" and sorted(w["rank"] for w in sim) != list(range(tp))):
        raise RuntimeError(f"TP={tp} arm {arm}: asked for device {device!r}, the workers' simulated devices are {sim}")
    if device == "sim":
        from hotloop.vllm.sim_device import requested

        want = requested() or sim_spec()
        got = {(w["base_us"], w["per_token_us"]) for w in sim}
        if got != {tuple(want)}:
            raise RuntimeError(f"TP={tp} arm {arm}: asked for a device step of {want[0]:g}+{want[1]:g} us, the workers' "
                               f"simulated devices run {sorted(got)}")
    if device == "sim" and {w["path"] for w in sim} != {"sync" if sync else "async"}:
        raise RuntimeError(f"TP={tp} arm {arm}: asked for the {'synchronous' if sync else 'async scheduling'} path, "
                           f"the workers run {sorted({w['path'] for w in sim})}")
    return res


FIGURES = {"req_per_s": ("req/s", 1), "tok_per_s": ("tok/s", 0), "ttft_p50_ms": ("TTFT p50 ms", 1),
           "ttft_p99_ms": ("TTFT p99 ms", 1), "itl_p50_ms": ("ITL p50 ms", 2), "itl_p99_ms": ("ITL p99 ms", 2),
           "queue_wait_p50_us": ("queue wait p50 us", 0), "queue_wait_p99_us": ("queue wait p99 us", 0),
           "handoff_p50_us": ("of it hand-off p50 us", 0),
           "cpu_s_per_1k_tok": ("CPU s / 1k tok", 2),
           "host_cpu_pct": ("engine core + workers CPU %", 0)}
SHAPE_FIGURES = {"arrivals": ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                              "queue_wait_p50_us", "handoff_p50_us", "queue_wait_p99_us", "cpu_s_per_1k_tok"),
                 "poisson": ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "queue_wait_p50_us",
                             "handoff_p50_us", "queue_wait_p99_us", "cpu_s_per_1k_tok"),
                 "decode": ("tok_per_s", "itl_p50_ms", "itl_p99_ms", "cpu_s_per_1k_tok", "host_cpu_pct"),
                 "single": ("tok_per_s", "itl_p50_ms", "itl_p99_ms", "cpu_s_per_1k_tok")}


def run(quick: bool = False, rounds: int | None = None, tps=None, seed: int = 0,
        plot_path: str | None = "hotloop-bench-vllm.png", device: str = "cpu", online: bool = False, arms=None,
        sync: bool = False):
    """Every TP size and arm for `rounds` rounds (see the module docstring); `device` "sim" runs the model on the
    simulated device (hotloop.vllm.sim_device) with vLLM's spinloop extension as a fourth arm, TP 1, 2 and 4 by
    default, on vLLM's GPU path (async scheduling) or with `sync` its synchronous one; `online` (sim only) runs the
    shapes through vllm serve and vllm bench serve (bench/vllm/online.py)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a vLLM that fails to import
        msg = f"skipped: vLLM is not importable here ({type(e).__name__}: {e}); pip install \"hotloop[vllm]\""
        return {"skipped": msg}, msg
    if sync and device != "sim":
        raise ValueError("--sync picks the simulated device's path (vLLM's CPU build has only the synchronous one): "
                         "add --device sim")
    if online:
        if device != "sim":
            raise ValueError("--online runs on the simulated device: add --device sim")
        return run_online(quick=quick, rounds=rounds, tps=tps, seed=seed, sync=sync)
    from hotloop.vllm import SUPPORTED_VLLM_VERSIONS, check_version, tiny_model

    version = check_version()
    tps = tuple(tps or ((1, 2, 4) if device == "sim" else (1, 2)))
    arms = tuple(arms or arms_for(device))
    if arms[0] != "vllm" or not set(arms) <= set(ARMS + SIM_ARMS + EXTRA_ARMS):
        raise ValueError(f"arms must start with vllm (the baseline) and be among {ARMS + SIM_ARMS + EXTRA_ARMS}, "
                         f"got {arms}")
    model = tiny_model.build(seed, heads=4 if 4 in tps else 2)
    rounds = rounds or (1 if quick else 3)
    raw, reference, differ = _run_rounds(rounds, tps, arms, model, quick, seed, device, sync)
    data = summarize(raw, tps, quick, rounds, arms, device)
    data.update({"vllm_version": version, "supported": list(SUPPORTED_VLLM_VERSIONS), "seed": seed,
                 "identical_greedy_outputs": not differ, "outputs_differ": sorted(differ), "device": device,
                 "single_token_ids": reference["single"][0], "token_ids_digest": outputs_digest(reference),
                 "path": "sync" if sync or device != "sim" else "async"})
    if device == "sim":
        from hotloop.vllm.sim_device import requested

        data["sim_device_us"] = requested() or sim_spec()
    full = set(arms) >= set(arms_for(device))
    data["goals"] = goals_sim(data, tps) if device == "sim" else goals(data, tps) if full else []
    if device == "cpu":  # the offline batch rows: vLLM's queue against hotloop's defaults (bench/vllm/batch.py)
        data["batch"] = batch.run(rounds=5 * rounds, tps=tps, say=lambda _line: None)
        data["goals"] += data["batch"]["goals"]
    text = render(data, tps, quick)
    if device == "cpu":
        text.append(batch.report(data["batch"]))
    if plot_path:
        text.append(_plot(data, raw, tps, plot_path))
    return data, text


def _run_rounds(rounds: int, tps, arms, model: str, quick: bool, seed: int, device: str, sync: bool):
    """Every TP and arm for `rounds` rounds, the arm that goes first rotating each round: (raw: (tp, arm) -> each
    round's figures, reference: the first engine's outputs per shape, differ: the runs whose outputs differ from them)."""
    progress = Progress(f"bench vllm ({device})", rounds * len(tps) * len(arms))
    raw = {(tp, arm): [] for tp in tps for arm in arms}
    reference, differ = {}, set()
    for rnd in range(rounds):
        order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]  # each arm goes first in turn
        for tp in tps:
            for arm in order:
                res = run_engine(tp, arm, model, quick, seed, device, sync)
                compare_outputs(res, "token_ids", reference, differ, f"TP={tp} {arm} round {rnd + 1}")
                raw[(tp, arm)].append(res)
                progress.step(f"round {rnd + 1} TP={tp} {arm}: poisson TTFT p50 "
                              f"{res['poisson']['ttft_p50_ms']:.1f} ms, decode {res['decode']['tok_per_s']:.0f} "
                              f"tok/s, host CPU {res['decode']['host_cpu_pct']:.0f} %, idle "
                              f"{res['idle_pct']['tree']:.1f} %")
    progress.close()
    return raw, reference, differ


def outputs_digest(outputs: dict) -> dict[str, str]:
    """Per shape, a digest of its outputs (the greedy token ids of every request, in order): another run's outputs
    compare equal by it without the record carrying them."""
    import hashlib

    return {shape: hashlib.sha256(json.dumps(v).encode()).hexdigest()[:16] for shape, v in outputs.items()}


def summarize(raw: dict, tps, quick: bool, rounds: int, arms=ARMS, device: str = "cpu") -> dict:
    """Per TP, shape, arm and figure: median (min-max) over rounds, and the within-round ratio of each other arm
    to vLLM's."""
    data = {"rounds": rounds, "arms": list(arms), "shapes": [dataclasses.asdict(s) for s in shapes(quick, device)],
            "tp": {}}
    for tp in tps:
        rec = data["tp"][tp] = {}
        for shape in shapes(quick, device):
            per = rec[shape.name] = {}
            for arm in arms:
                runs = [r[shape.name] for r in raw[(tp, arm)]]
                per[arm] = {k: over_rounds([r[k] for r in runs]) for k in FIGURES}
                per[arm]["hops_ms"] = {h: median([r["hops_ms"].get(h, math.nan) for r in runs])
                                       for h in runs[0]["hops_ms"]}
                per[arm]["waits_during_step"] = sum(r["waits_during_step"] for r in runs)
                per[arm]["cpu_pct"] = {k: median([r["cpu_pct"].get(k, 0.0) for r in runs])
                                       for k in sorted(set().union(*(r["cpu_pct"] for r in runs)))}
                if arm != "vllm":
                    own_runs = [r[shape.name] for r in raw[(tp, "vllm")]]
                    per[f"{arm}/vLLM"] = {k: over_rounds([_ratio_or_nan(h[k], o[k]) for h, o in zip(runs, own_runs)])
                                          for k in FIGURES}
                if all(r.get("read_cpu") for r in runs):  # exact waiting CPU (read_cpu.py), every arm alike
                    per[arm]["read_cpu"] = {k: over_rounds([read_cpu_per_1k(r)[k] for r in runs])
                                            for k in read_cpu_per_1k(runs[0])}
                    if arm != "vllm" and all(r.get("read_cpu") for r in own_runs):
                        per[f"{arm}/vLLM"]["wait_cpu"] = over_rounds(
                            [_ratio_or_nan(read_cpu_per_1k(h)["wait_total"], read_cpu_per_1k(o)["wait_total"])
                             for h, o in zip(runs, own_runs)])
                if all(r.get("chains") for r in runs):  # hotloop's readers: parks after each kind of message
                    per[arm]["chains"] = {side: merged([r["chains"][side] for r in runs])
                                          for side in ("engine_core", "workers")}
                if all(r.get("cgroup") for r in runs):  # the pod regime: the quota's throttling over the shape
                    per[arm]["cgroup"] = {k: over_rounds([r["cgroup"][k] for r in runs])
                                          for k in ("throttled_periods", "throttled_s", "periods")}
        rec["idle"] = {arm: {k: over_rounds([r["idle_pct"][k] for r in raw[(tp, arm)]]) for k in IDLE_PARTS}
                       for arm in arms}
        if all("sampled" in r for arm in arms for r in raw[(tp, arm)]):
            rec["sampled"] = _summarize_sampled({arm: [r["sampled"] for r in raw[(tp, arm)]] for arm in arms})
    return data


def read_cpu_per_1k(run: dict) -> dict:
    """One shape's queue reads (read_cpu.py) in CPU milliseconds per 1000 output tokens: the waiting CPU of the engine
    core's reads, of the workers' together, both ("wait_total"), and the deserialization's ("loads_total")."""
    per = 1000.0 / max(1, run["tokens"]) / 1e6
    reads = run["read_cpu"]
    workers = [v for k, v in reads.items() if k.startswith("worker")]
    core = reads["engine_core"]
    return {"wait_engine_core": core["wait_cpu_ns"] * per,
            "wait_workers": sum(w["wait_cpu_ns"] for w in workers) * per,
            "wait_total": (core["wait_cpu_ns"] + sum(w["wait_cpu_ns"] for w in workers)) * per,
            "loads_total": (core["loads_cpu_ns"] + sum(w["loads_cpu_ns"] for w in workers)) * per,
            "reads": core["reads"] + sum(w["reads"] for w in workers)}


def _ratio_or_nan(a: float, b: float) -> float:
    return a / b if b else math.nan


def sampled_totals(run: dict) -> dict:
    """One sampled repetition's sums over the engine core and the workers: waiting CPU, measured CPU (% of a core)."""
    mine = [v for k, v in run.items() if k == "engine_core" or k.startswith("worker")]
    return {"waiting_cpu_pct": sum(v["waiting_cpu_pct"] for v in mine),
            "measured_cpu_pct": sum(v["measured_cpu_pct"] for v in mine),
            "output_thread_waiting_cpu_pct": sum(v["output_thread_waiting_cpu_pct"] for v in mine)}


def _summarize_sampled(per_arm: dict[str, list[dict]]) -> dict:
    """Per arm: each process's figures (median over rounds), the engine core + workers' totals, and the totals'
    within-round ratios to vLLM's (and to vLLM with its spinloop extension, where that arm ran)."""
    out = {}
    for arm, runs in per_arm.items():
        procs = sorted(set().union(*runs))
        out[arm] = {name: {k: median([r[name][k] for r in runs if name in r])
                           for k in ("waiting_share", "waiting_cpu_pct", "work_cpu_pct", "measured_cpu_pct",
                                     "output_thread_waiting_cpu_pct")} for name in procs}
        for name in procs:
            out[arm][name]["check"] = [r[name]["check"] for r in runs if name in r]
            out[arm][name]["top_waiting"] = runs[-1].get(name, {}).get("top_waiting", [])
            out[arm][name]["top_work"] = runs[-1].get(name, {}).get("top_work", [])
        totals = [sampled_totals(r) for r in runs]
        out[arm]["total"] = {k: over_rounds([t[k] for t in totals]) for k in totals[0]}
        for base in ("vllm", "vllm+spinloop"):
            if arm != base and base in per_arm:
                own = [sampled_totals(r) for r in per_arm[base]]
                out[arm][f"/{base}"] = {k: over_rounds([t[k] / o[k] if o[k] else math.nan for t, o in zip(totals, own)])
                                        for k in ("waiting_cpu_pct", "measured_cpu_pct")}
    return out


def goals(data: dict, tps) -> list[dict]:
    """The issue's goals for the loop arm (median of within-round ratios to vLLM's)."""
    loop, out = "hotloop+loop", []

    def ratio(tp, shape, key):
        return data["tp"][tp][shape][f"{loop}/vLLM"][key]["median"]

    qw = {f"TP={tp} {s}": data["tp"][tp][s][loop]["queue_wait_p50_us"]["median"] for tp in tps
          for s in ("arrivals", "poisson")}
    out.append({"goal": "queue wait p50 <= 100 us with the loop", "met": all(v <= 100 for v in qw.values()),
                "detail": ", ".join(f"{k} {v:.0f} us" for k, v in qw.items())})
    lat = {f"TP={tp} {s} {k.split('_ms')[0]}": ratio(tp, s, k) for tp in tps for s in ("poisson", "arrivals")
           for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
    out.append({"goal": "TTFT and ITL p50 / p99 <= 1.0x vLLM's (Poisson, arrivals)",
                "met": all(v <= 1.0 for v in lat.values()),
                "detail": ", ".join(f"{k} {v:.2f}" for k, v in lat.items() if not v <= 1.0) or "all within"})
    thr = {f"TP={tp} {s}": ratio(tp, s, "req_per_s" if s == "arrivals" else "tok_per_s") for tp in tps
           for s in ("arrivals", "poisson", "decode", "single")}
    out.append({"goal": "req/s and tok/s >= 1.0x vLLM's in every shape", "met": all(v >= 1.0 for v in thr.values()),
                "detail": ", ".join(f"{k} {v:.2f}" for k, v in thr.items())})
    cpu = {f"TP={tp} {s}": ratio(tp, s, "cpu_s_per_1k_tok") for tp in tps
           for s in ("arrivals", "poisson", "decode", "single")}
    out.append({"goal": "CPU per 1000 tokens <= 0.6x vLLM's in every shape", "met": all(v <= 0.6 for v in cpu.values()),
                "detail": ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())})
    idle = {tp: data["tp"][tp]["idle"][loop]["waiters"]["median"] for tp in tps}
    out.append({"goal": "idle after a burst, the threads hotloop waits in (engine core's and workers' main threads) "
                        "<= 0.1 % of a core (loop arm)",
                "met": all(v <= 0.1 for v in idle.values()),
                "detail": ", ".join(f"TP={tp} {v:.2f} %" for tp, v in idle.items())})
    out.append({"goal": "greedy outputs identical across the three arms", "met": data["identical_greedy_outputs"],
                "detail": ("yes" if data["identical_greedy_outputs"]
                           else "differ: " + ", ".join(data["outputs_differ"]))})
    return out


def _device_words(data: dict) -> str:
    if data.get("device") != "sim":
        return ""
    base, per_token = data["sim_device_us"]
    path = "async scheduling" if data.get("path") == "async" else "synchronous path"
    return f" on the simulated device ({base:g} us + {per_token:g} us a token per step, vLLM's {path})"


def goals_sim(data: dict, tps) -> list[dict]:
    """The simulated device's goals: each hotloop arm against vLLM (median of within-round ratios) at every TP.
    A run of some arms only reads the goals of those present (the CPU goal against the spinloop extension needs
    its arm, the hand-off goal the loop's)."""
    out = []
    tp_all = list(tps)
    arms = data["arms"]
    for arm in [a for a in ("hotloop", "hotloop+loop") if a in arms]:
        out += _sim_arm_goals(data, arm, tp_all)
    if "hotloop+loop" in arms:
        hand = {f"TP={tp} {s}": data["tp"][tp][s]["hotloop+loop"]["handoff_p50_us"]["median"] for tp in tp_all
                for s in ("arrivals", "poisson")}
        out.append({"goal": "hotloop+loop: hand-off from the input thread to the scheduler during a step p50 <= 50 us",
                    "met": all(v <= 50 for v in hand.values()),
                    "detail": ", ".join(f"{k} {v:.0f} us" for k, v in hand.items())})
    ours = [a for a in arms if a.startswith("hotloop")]
    if ours:
        idle = {tp: max(data["tp"][tp]["idle"][arm]["waiters"]["median"] for arm in ours) for tp in tp_all}
        out.append({"goal": "idle after a burst: the threads hotloop waits in <= 0.05 % of a core",
                    "met": all(v <= 0.05 for v in idle.values()),
                    "detail": ", ".join(f"TP={tp} {v:.3f} %" for tp, v in idle.items())})
    out.append(identical_goal(data, "greedy outputs"))
    return out


def _sim_ratio(data: dict, tp, arm: str, shape: str, key: str, base: str = "vllm") -> float:
    """`arm`'s figure over `base`'s: against vLLM the median of the within-round ratios, against another arm the
    ratio of the medians (NaN where the base's is 0)."""
    if base == "vllm":
        return data["tp"][tp][shape][f"{arm}/vLLM"][key]["median"]
    return (data["tp"][tp][shape][arm][key]["median"] / data["tp"][tp][shape][base][key]["median"]
            if data["tp"][tp][shape][base][key]["median"] else math.nan)


def _sim_arm_goals(data: dict, arm: str, tps: list) -> list[dict]:
    """One hotloop arm's goals on the simulated device: throughput, tail latency, the waiting CPU (where the run
    sampled it) and the host CPU while decoding, at every TP."""
    out = []
    thr = {f"TP={tp} {s}": _sim_ratio(data, tp, arm, s, "req_per_s" if s == "arrivals" else "tok_per_s")
           for tp in tps for s in ("arrivals", "decode", "single")}
    out.append({"goal": f"{arm}: req/s (arrivals) and tok/s (decode, single) >= 1.0x vLLM's",
                "met": all(v >= 1.0 for v in thr.values()),
                "detail": ", ".join(f"{k} {v:.2f}" for k, v in thr.items())})
    lat = {f"TP={tp} {s} {k.split('_ms')[0]}": _sim_ratio(data, tp, arm, s, k) for tp in tps
           for s in ("arrivals", "poisson") for k in ("ttft_p99_ms", "itl_p99_ms")}
    out.append({"goal": f"{arm}: TTFT p99 and ITL p99 (arrivals, Poisson) <= 0.9x vLLM's",
                "met": all(v <= 0.9 for v in lat.values()),
                "detail": ", ".join(f"{k} {v:.2f}" for k, v in lat.items())})
    if all("sampled" in data["tp"][tp] for tp in tps):
        out.append(_sampled_waiting_goal(data, arm, tps))
    cpu = {f"TP={tp}": _sim_ratio(data, tp, arm, "decode", "host_cpu_pct") for tp in tps}
    if "vllm+spinloop" in data["arms"]:
        cpu_spin = {f"TP={tp}": _sim_ratio(data, tp, arm, "decode", "host_cpu_pct", base="vllm+spinloop")
                    for tp in tps}
        out.append({"goal": f"{arm}: host CPU of the engine core and workers while decoding <= 0.25x vLLM's and "
                            "<= 0.5x vLLM's with its spinloop extension",
                    "met": all(v <= 0.25 for v in cpu.values()) and all(v <= 0.5 for v in cpu_spin.values()),
                    "detail": ", ".join(f"{k} {cpu[k]:.2f} / {cpu_spin[k]:.2f}" for k in cpu)})
    else:
        out.append({"goal": f"{arm}: host CPU of the engine core and workers while decoding <= 0.25x vLLM's",
                    "met": all(v <= 0.25 for v in cpu.values()),
                    "detail": ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())})
    return out


def _sampled_waiting_goal(data: dict, arm: str, tps: list) -> dict:
    """`arm`'s waiting CPU of the engine core and workers while decoding (sampled), against vLLM's and, where that
    arm ran, vLLM's with its spinloop extension."""
    w = {f"TP={tp}": data["tp"][tp]["sampled"][arm]["/vllm"]["waiting_cpu_pct"]["median"] for tp in tps}
    whole = {f"TP={tp}": data["tp"][tp]["sampled"][arm]["/vllm"]["measured_cpu_pct"]["median"] for tp in tps}
    spin = ({f"TP={tp}": data["tp"][tp]["sampled"][arm]["/vllm+spinloop"]["waiting_cpu_pct"]["median"]
             for tp in tps} if "vllm+spinloop" in data["arms"] else {})
    return {"goal": f"{arm}: waiting CPU of the engine core and workers while decoding (sampled) <= 0.05x "
                    "vLLM's" + (" and <= 0.1x vLLM's with its spinloop extension" if spin else ""),
            "met": all(v <= 0.05 for v in w.values()) and all(v <= 0.1 for v in spin.values()),
            "detail": ", ".join(f"{k} {w[k]:.2f}" + (f" / {spin[k]:.2f}" if spin else "") +
                                f" (whole processes {whole[k]:.2f})" for k in w)}


def render(data: dict, tps, quick: bool) -> Report:
    parts = []
    n = data["rounds"]
    arms = tuple(data["arms"])
    for shape in data["shapes"]:
        keys = SHAPE_FIGURES[shape["name"]]
        rows = []
        for tp in tps:
            per = data["tp"][tp][shape["name"]]
            for arm in arms:
                rows.append([f"TP={tp} {arm}"] + [median_range(per[arm][k], FIGURES[k][1]) for k in keys])
            for arm in arms[1:]:
                rows.append([f"TP={tp} {arm}/vLLM"] + [median_range(per[f"{arm}/vLLM"][k], 2) for k in keys])
        how = "all at once" if shape["rate"] <= 0 else f"Poisson {shape['rate']:g} req/s"
        parts.append(table(
            f"vLLM {data['vllm_version']} AsyncLLM{_device_words(data)}, shape '{shape['name']}': "
            f"{shape['n']} requests of {shape['prompt_tokens']} prompt / {shape['output_tokens']} output tokens, "
            f"{how}; median (min-max) over {n} round{'s' * (n > 1)}", ["TP / arm"] + [FIGURES[k][0] for k in keys],
            rows))
    hop_rows = []
    for tp in tps:
        for arm in arms:
            hops = data["tp"][tp]["poisson"][arm]["hops_ms"]
            hop_rows.append([f"TP={tp} {arm}"] + [fmt(hops.get(h, math.nan), 2) for h in _hop_names()])
    parts.append(table("Where a request's time to first token goes (shape 'poisson'; ms, median over requests, "
                       "then over rounds)", ["TP / arm"] + list(_hop_names()), hop_rows,
                       note="Stamps from CLOCK_MONOTONIC in each process (hotloop.vllm.timeline, every arm): front "
                            "end submit -> (the front end's client sends) -> engine core read -> scheduler -> step "
                            "broadcast -> worker read -> step done -> response read -> outputs made -> first output "
                            "at the front end."))
    idle_rows = [[f"TP={tp} {arm}"] + [median_range(data["tp"][tp]["idle"][arm][k], 2) for k in IDLE_PARTS]
                 for tp in tps for arm in arms]
    parts.append(table("Idle CPU in the 3 s after the last burst, percent of one core (every thread's schedstat)",
                       ["TP / arm", "process tree", "gloo loops", "engine core + workers' main threads",
                        "front end process", "every other thread"], idle_rows,
                       note="The main threads of the engine core and the workers are where the queue's waits and "
                            "the engine-core loop run; torch's gloo loop threads wake every 10 ms in every arm."))
    parts.append(table("Host CPU while decoding (shape 'decode'), percent of one core per process (every thread's "
                       "schedstat over the shape's span; median over rounds)",
                       ["TP / arm", "front end", "engine core", "each worker", "engine core + workers", "other"],
                       cpu_rows(data, tps, lambda tp, arm, pct: [fmt(pct.get("engine_core+workers"), 0),
                                                                  fmt(pct.get("other", 0.0), 0)])))
    if all("sampled" in data["tp"][tp] for tp in tps):
        parts.append(_sampled_table(data, tps))
    reads = _read_cpu_table(data, tps)
    if reads is not None:
        parts.append(reads)
    chains = _chain_table(data, tps)
    if chains is not None:
        parts.append(chains)
    parts.append(goal_lines(data["goals"]))
    parts.append("Method: one fresh engine per TP and arm (vLLM: vLLM's queue and loop; hotloop: hotloop's queue, "
                 "vLLM's loop; hotloop+loop: hotloop's queue and engine-core loop) runs every shape in turn after a "
                 "warm-up; arms alternate which goes first each round; ratios are taken within a round. CPU: the "
                 "process tree's utime + stime. Queue wait: the engine core's input thread to the scheduler (of it "
                 "hand-off: from the end of the input thread's preprocessing, i.e. the queue itself). "
                 "Greedy outputs compared across arms and rounds per shape.")
    return Report(parts)


def _sampled_table(data: dict, tps):
    """Where the host CPU goes while decoding, sampled (bench/host_samples.py)."""
    rows = []
    for tp in tps:
        for arm in data["arms"]:
            rec = data["tp"][tp]["sampled"][arm]
            workers = sorted(k for k in rec if k.startswith("worker"))

            def cell(name):
                v = rec[name]
                return (f"{fmt(v['waiting_cpu_pct'], 1)} / {fmt(v['measured_cpu_pct'], 0)} "
                        f"({fmt(100 * v['waiting_share'], 0)} %)")

            ratio = rec.get("/vllm", {}).get("waiting_cpu_pct")
            tot = rec["total"]
            rows.append([f"TP={tp} {arm}", cell("front_end"), cell("engine_core"),
                         " + ".join(cell(w) for w in workers),
                         " + ".join(fmt(rec[w]["output_thread_waiting_cpu_pct"], 1) for w in workers),
                         f"{fmt(tot['waiting_cpu_pct']['median'], 1)} / {fmt(tot['measured_cpu_pct']['median'], 0)}",
                         fmt(ratio["median"], 2) if ratio else "-",
                         "ok" if all(c == "ok" for k in rec if not k.startswith(("total", "/"))
                                     for c in rec[k]["check"]) else "see JSON"])
    return table(f"Where the host CPU goes while decoding, sampled (py-spy at {SAMPLE_HZ} Hz for {SAMPLE_S} s on a "
                 "repetition of the decode shape): waiting CPU / measured CPU, % of a core (waiting share of the "
                 "samples)",
                 ["TP / arm", "front end", "engine core", "each worker", "of it the output thread waiting",
                  "engine core + workers waiting / measured", "waiting x vLLM", "sampler check"], rows,
                 note="Waiting: vLLM's SpinCondition / sched_yield / zmq poll, hotloop's wait (its dequeue frame), "
                      "the device event's synchronize; work: the rest (bench/host_samples.py, WAIT_FRAMES). The "
                      "unpickling inside a read is work in both arms: HOTLOOP_VLLM_READ_CPU's timing wrapper is its "
                      "innermost Python frame (in hotloop's arm it is called from C++ under the dequeue frame). Measured: every thread's schedstat over the window. "
                      "Medians over rounds; the ratio is the median of within-round ratios.",
                 key="sampled")


def _read_cpu_table(data: dict, tps):
    """Exact waiting CPU of the queue reads (read_cpu.py), shapes 'decode' and 'poisson', per 1000 output tokens."""
    rows = []
    for tp in tps:
        for shape in ("decode", "poisson"):
            for arm in data["arms"]:
                rc = data["tp"][tp][shape][arm].get("read_cpu")
                if rc is None:
                    continue
                ratio = data["tp"][tp][shape].get(f"{arm}/vLLM", {}).get("wait_cpu")
                rows.append([f"TP={tp} {arm}", shape, median_range(rc["wait_engine_core"], 1),
                             median_range(rc["wait_workers"], 1), median_range(rc["wait_total"], 1),
                             median_range(ratio, 2) if ratio else "-", median_range(rc["loads_total"], 1),
                             fmt(rc["reads"]["median"], 0)])
    if not rows:
        return None
    return table("Waiting CPU of the queue reads, exact: CPU ms per 1000 output tokens (each read's thread CPU less "
                 "its deserialization's; median (min-max) over rounds)",
                 ["TP / arm", "shape", "engine core", "workers", "engine core + workers", "x vLLM (within round)",
                  "deserialization (apart)", "reads"], rows, key="read_cpu",
                 note="Every arm counted alike (hotloop.vllm.read_cpu: time.thread_time_ns around each dequeue and "
                      "around the unpickling inside it, vLLM's pickle.loads and hotloop's loaders); the waiting CPU "
                      "is the spin, the yields, the futex calls and the bookkeeping of the reads.")


def _chain_table(data: dict, tps):
    """hotloop's readers, shapes 'decode' and 'poisson': per kind of the message read before, how many of the
    reads after it parked in the kernel, and how many were given the chain's yield budget (chained_reads.py)."""
    rows = []
    for tp in tps:
        for arm in data["arms"]:
            for shape in ("decode", "poisson"):
                chains = data["tp"][tp][shape][arm].get("chains")
                if not chains:
                    continue
                for side in ("workers", "engine_core"):
                    for kind, c in sorted(chains[side].items()):
                        rows.append([f"TP={tp} {arm}", shape, side.replace("_", " "), kind, c["reads"], c["parks"],
                                     f"{100 * c['parks'] / c['reads']:.0f} %" if c["reads"] else "-", c["chained"],
                                     fmt(c["wait_us"] / c["reads"], 0) if c["reads"] else "-"])
    if not rows:
        return None
    return table("hotloop's readers: the reads after each kind of message (all rounds), how many parked in the kernel "
                 "(a futex sleep and wake-up each) and how many yielded through the gap as a chain",
                 ["TP / arm", "shape", "reader", "message before", "reads", "parked", "parked %", "chained",
                  "mean wait us"], rows, key="chains",
                 note="A worker reads a step's execute_model then its sample_tokens, tens of us apart; a read after "
                      "a kind whose follower came within 200 us on average yields up to 300 us before it parks "
                      "(HOTLOOP_VLLM_CHAINS=0: off).")


def _hop_names():
    from hotloop.vllm.timeline import HOPS, SEND_HOPS

    return HOPS + ("time to first token",) + SEND_HOPS


def _plot(data: dict, raw: dict, tps, path: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_PLOT
    fig, axes = plt.subplots(1, 3, figsize=(20, 5))
    last = data["arms"][-1]
    # 1: the loop arm's within-round ratios to vLLM's, per goal figure, with the goal lines
    ax = axes[0]
    labels, vals, lo, hi = [], [], [], []
    for tp in tps:
        for s, k in (("poisson", "ttft_p50_ms"), ("poisson", "ttft_p99_ms"), ("poisson", "itl_p99_ms"),
                     ("arrivals", "ttft_p99_ms"), ("arrivals", "req_per_s"), ("decode", "tok_per_s"),
                     ("single", "tok_per_s"), ("poisson", "cpu_s_per_1k_tok")):
            st = data["tp"][tp][s][f"{last}/vLLM"][k]
            labels.append(f"TP{tp} {s}\n{FIGURES[k][0]}")
            vals.append(st["median"])
            lo.append(st["median"] - st["min"])
            hi.append(st["max"] - st["median"])
    ax.bar(range(len(vals)), vals, yerr=[lo, hi], capsize=3, color="tab:green")
    ax.axhline(1.0, color="k", lw=1, ls="--", label="vLLM (1.0)")
    ax.axhline(0.6, color="tab:red", lw=1, ls=":", label="CPU goal (0.6)")
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=60)
    ax.set(title=f"{last} / vLLM within each round (median, min-max)")
    ax.legend(fontsize=8)
    # 2: where time to first token goes, per arm (poisson, largest TP)
    ax = axes[1]
    tp = max(tps)
    arms = tuple(data["arms"])
    bottom = [0.0] * len(arms)
    from hotloop.vllm.timeline import HOPS

    for h in HOPS:
        v = [data["tp"][tp]["poisson"][arm]["hops_ms"].get(h, 0.0) or 0.0 for arm in arms]
        v = [0.0 if isinstance(x, float) and math.isnan(x) else x for x in v]
        ax.bar(range(len(arms)), v, bottom=bottom, label=h)
        bottom = [b + x for b, x in zip(bottom, v)]
    ax.set_xticks(range(len(arms)), arms)
    ax.set(title=f"time to first token by hop, TP={tp} poisson (ms, medians)")
    ax.legend(fontsize=6)
    # 3: TTFT distributions, poisson, largest TP
    cdf_panel(axes[2], {arm: [x for r in raw[(tp, arm)] for x in r["poisson"]["ttft_ms"]] for arm in arms},
              f"time to first token (ms), TP={tp} poisson, all rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plotted to {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.offline")
    ap.add_argument("--shapes-driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 round of the short shapes")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--tp-sizes", default=None, help="tensor parallel sizes (default 1,2; 1,2,4 with --device sim)")
    ap.add_argument("--device", choices=("cpu", "sim"), default="cpu",
                    help="cpu: vLLM's CPU build computes the model; sim: the simulated device "
                    "(hotloop.vllm.sim_device, HOTLOOP_VLLM_SIM_DEVICE=BASE_US+PER_TOKEN_US to change its step time)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, the prompts and the arrivals")
    ap.add_argument("--arms", default=None, help="comma-separated arms, vllm first (default: the device's; "
                    f"also {', '.join(EXTRA_ARMS)})")
    ap.add_argument("--online", action="store_true", help="with --device sim: through vllm serve and vllm bench serve")
    ap.add_argument("--sync", action="store_true", help="with --device sim: vLLM's synchronous path (async scheduling "
                    "off) instead of the GPU default")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH", default="hotloop-bench-vllm.png")
    args = ap.parse_args(argv)
    if args.shapes_driver:
        return _shapes_driver(args)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    tps = tuple(int(t) for t in args.tp_sizes.split(",")) if args.tp_sizes else None
    data, text = run(quick=args.quick, rounds=args.rounds, tps=tps, seed=args.seed, plot_path=args.plot,
                     device=args.device, online=args.online, arms=args.arms.split(",") if args.arms else None,
                     sync=args.sync)
    from hotloop.bench.report import print_result

    return print_result("vllm", data, text, args.json)


if __name__ == "__main__":
    sys.exit(main())
