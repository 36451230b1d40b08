"""``hotloop bench orchestrator``: the event-driven orchestrator next to the legacy poll loop, in one run.

Pipeline: an LLM stage (the hotloop engine, model "tiny") streaming chunks of CHUNK tokens to a transform stage
(the vocoder process), which streams float frames to the caller. For each loop, in alternating rounds:

- idle CPU: this process's CPU (the orchestrator runs here; replicas are other processes) while no request runs;
- TTFP (send -> first packet) p50 / p99 at several concurrency levels (each "user" sends requests back to back);
- inter-packet gap p99, and the share of gaps longer than one packet's playback time (CHUNK tokens of audio);
- throughput: packets per second at the highest concurrency.
Figures are medians over rounds; the spread (half the range) shows the noise.
"""

from __future__ import annotations

import asyncio
import time

from hotloop.bench.report import Progress, Report, fmt, median_spread, percentile, table

CHUNK = 4
MAX_TOKENS = 24
LOOPS = ("event", "poll")


def _playback_s() -> float:
    from hotloop.orchestrator.vocoder import HOP, SAMPLE_RATE

    return CHUNK * HOP / SAMPLE_RATE


async def _user(orch, n: int, seed: int, ttft: list, gaps: list, packets: list):
    for i in range(n):
        t0 = time.perf_counter()
        last = None
        async for _ in orch.generate([256, (seed * 7 + i) % 256, 65, 66], max_tokens=MAX_TOKENS, ignore_eos=True):
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                gaps.append(now - last)
            last = now
            packets[0] += 1


async def _load(orch, concurrency: int, per_user: int) -> dict:
    ttft, gaps, packets = [], [], [0]
    t0 = time.perf_counter()
    await asyncio.gather(*(_user(orch, per_user, u, ttft, gaps, packets) for u in range(concurrency)))
    dt = time.perf_counter() - t0
    play = _playback_s()
    return {"ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "gap_p99_ms": percentile(gaps, 99) * 1e3,
            "late_gap_pct": 100 * sum(g > play for g in gaps) / max(1, len(gaps)),
            "packets_per_s": packets[0] / dt}


async def _round(loop: str, p: dict, progress: Progress) -> dict:
    from hotloop.orchestrator import Orchestrator, StageSpec

    orch = await Orchestrator.start([StageSpec("llm", options={"model": "tiny"}, stream_chunk_tokens=CHUNK),
                                     StageSpec("transform")], loop=loop)
    try:
        async for _ in orch.generate("warm up", max_tokens=4):
            pass
        progress.step(f"{loop}: idle {p['idle_s']:g} s")
        await asyncio.sleep(0.2)
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(p["idle_s"])
        out = {"idle_cpu_pct": 100 * (time.process_time() - c0) / (time.monotonic() - t0)}
        for c in p["concurrency"]:
            progress.step(f"{loop}: concurrency {c}")
            out[c] = await _load(orch, c, p["per_user"])
    finally:
        await orch.shutdown()
    return out


def run(quick: bool = False):
    p = (dict(rounds=1, idle_s=3.0, concurrency=(1, 8, 32), per_user=3) if quick else
         dict(rounds=3, idle_s=10.0, concurrency=(1, 8, 32), per_user=8))
    progress = Progress("bench orchestrator", p["rounds"] * len(LOOPS) * (1 + len(p["concurrency"])))
    rounds = {loop: [] for loop in LOOPS}
    for _ in range(p["rounds"]):
        for loop in LOOPS:  # alternating, so drift on a noisy machine hits both loops alike
            rounds[loop].append(asyncio.run(_round(loop, p, progress)))
    progress.close()

    def med(loop, key, c=None):
        return median_spread([r[key] if c is None else r[c][key] for r in rounds[loop]])

    data, rows = {}, []
    top = max(p["concurrency"])
    for loop in LOOPS:
        d = {"idle_cpu_pct": med(loop, "idle_cpu_pct")}
        for c in p["concurrency"]:
            for k in ("ttft_p50_ms", "ttft_p99_ms", "gap_p99_ms", "late_gap_pct", "packets_per_s"):
                d[f"c{c}_{k}"] = med(loop, k, c)
        data[loop] = {k: v[0] for k, v in d.items()} | {k + "_spread": v[1] for k, v in d.items()}
        row = [loop, fmt(d["idle_cpu_pct"][0], 3)]
        for c in p["concurrency"]:
            row += [fmt(d[f"c{c}_ttft_p50_ms"][0], 1), fmt(d[f"c{c}_ttft_p99_ms"][0], 1)]
        row += [fmt(d["c8_gap_p99_ms"][0], 1), fmt(d["c8_late_gap_pct"][0], 1),
                fmt(d[f"c{top}_packets_per_s"][0], 0)]
        rows.append(row)
    heads = ["loop", "idle CPU %"]
    for c in p["concurrency"]:
        heads += [f"TTFP c{c} p50 ms", "p99"]
    heads += ["gap p99 c8 ms", f"gaps > {_playback_s() * 1e3:.0f} ms %", f"packets/s c{top}"]
    ev, po = data["event"], data["poll"]
    note = (f"medians over {p['rounds']} alternating round(s), {p['per_user']} requests per user, "
            f"{MAX_TOKENS} tokens in chunks of {CHUNK}; spreads (half the range) in --json. "
            f"event vs poll: idle CPU {fmt(ev['idle_cpu_pct'], 3)} vs {fmt(po['idle_cpu_pct'], 3)} %, "
            f"TTFP p99 at c8 {fmt(ev['c8_ttft_p99_ms'])} vs {fmt(po['c8_ttft_p99_ms'])} ms "
            f"(spread {fmt(ev['c8_ttft_p99_ms_spread'])} / {fmt(po['c8_ttft_p99_ms_spread'])}).")
    data["goals"] = []  # figures side by side; no goal is stated for them
    return data, Report([table("orchestrator A/B: LLM stage -> transform stage, streaming", heads, rows, note=note)])
