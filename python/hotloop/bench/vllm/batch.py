"""``hotloop bench vllm``'s batch rows: vLLM's CPU build computing the model (no simulated device), the offline
``LLM.generate`` API, batch 1 and batch 16, TP = 1 and 2, vLLM's queue against hotloop's defaults.

This is the case a new user tries first on a machine without a GPU, and the one where the processes (front end,
engine core, one worker per rank) outnumber the cores: every wait competes with the model's compute for a core.

Method: per TP, one engine per arm (``driver.Driver``: a fresh driver process, MultiprocExecutor, the tiny
random Llama, float32, OpenMP threads bound one core per rank), all started before the first burst and kept alive
together. A round runs, for each batch size, each arm's burst in turn (the arm that goes first rotating each
round): ``bursts`` x ``LLM.generate`` of ``batch`` prompts and ``max_tokens`` greedy tokens (EOS ignored). After
a burst of vLLM's queue the bench waits ``settle_s`` (1.2 s): vLLM's readers spin for 1 s after their last message,
and a spinning engine left behind would take a core from the next arm (hotloop's readers park: nothing to wait
for). Per burst: output tokens / wall seconds, and CPU seconds of the arm's whole process tree per 1000 tokens
(every thread's schedstat; by process too: front end, engine core, each worker). Ratios are taken within a round
(the same few seconds of the same machine), then the median over rounds; many short rounds, so that a noisy
second hits every arm alike and the median leaves it out. Greedy token ids are compared across arms.

With ``HOTLOOP_VLLM_SIM_DEVICE`` set (every engine inherits it) the model runs on the simulated device instead
(``hotloop.vllm.sim_device``: vLLM's async scheduling path, its host work real): the same bench for the GPU regime.

``python -m hotloop.bench.vllm.batch [--rounds N] [--tp-sizes 1,2] [--arms vllm,hotloop,...] [--json PATH]``;
``--arm-env NAME=K=V,K=V`` adds an arm (hotloop's queue with those variables), for A/B runs of a policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from hotloop.bench.report import goal_lines
from hotloop.bench.vllm.arms import check_queue_class
from hotloop.bench.vllm.driver import Driver
from hotloop.bench.vllm.processes import cpu_by_process

BATCHES = (1, 16)
MAX_TOKENS = 64
# vllm: vLLM's own queue and loop; hotloop: HOTLOOP_VLLM=1 with every other switch at its default (the rule in
# hotloop.vllm.defaults decides the wait); the others force one policy for A/B runs
ARM_ENV = {
    "vllm": {"HOTLOOP_VLLM": "0"},
    "hotloop": {"HOTLOOP_VLLM": "1"},
    "hotloop-paced": {"HOTLOOP_VLLM": "1", "HOTLOOP_VLLM_PACED": "1"},
    "hotloop-plain": {"HOTLOOP_VLLM": "1", "HOTLOOP_VLLM_PACED": "0"},
}
# switches the bench's other drivers set; left to the defaults here (the arm's env names them when it forces one)
_DEFAULTED = ("HOTLOOP_VLLM_PACED", "HOTLOOP_VLLM_LOOP", "HOTLOOP_VLLM_TIMELINE", "HOTLOOP_VLLM_YIELD_US")
GOALS = {"tok_ratio_min": 1.0, "cpu_ratio_max": {1: 0.75, 16: 0.9}}


def _start(tp: int, arm: str, env: dict, model: str):
    # Driver's arm_env sets the paced / loop / timeline switches for the shapes bench; here an arm leaves unset
    # whatever its env does not name (the defaults under test), the timeline's stamps included
    arm_kind = "vllm" if env.get("HOTLOOP_VLLM") == "0" else "hotloop"
    driver = Driver(tp, arm_kind, model, env_extra=dict.fromkeys(_DEFAULTED) | env)
    check_queue_class(arm_kind, driver.queue_class)
    return driver


def _burst(driver, batch: int, bursts: int, max_tokens: int) -> dict:
    c0, tokens, wall, ids = cpu_by_process(driver.pid), 0, 0.0, None
    for _ in range(bursts):
        out = driver.generate(batch, max_tokens)
        if "error" in out:
            raise RuntimeError(f"TP={driver.tp} arm {driver.arm}: {out['error']}: {out['message']}")
        tokens += sum(len(t) for t in out["token_ids"])
        wall += out["wall_s"]
        ids = out["token_ids"]
    c1 = cpu_by_process(driver.pid)
    cpu = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
    return {"tok_per_s": tokens / wall, "cpu_ms_per_tok": 1e3 * sum(cpu.values()) / tokens,
            "cpu_pct": {k: 100.0 * v / wall for k, v in sorted(cpu.items())}, "token_ids": ids}


def run_tp(tp: int, arms: dict, rounds: int, bursts: int, max_tokens: int, settle_s: float, model: str,
           say=print) -> dict:
    """Every arm's engine at `tp`, alive together, through `rounds` rounds of every batch size; raw figures."""
    drivers = {}
    raw = {(b, a): [] for b in BATCHES for a in arms}
    try:
        for arm, env in arms.items():
            drivers[arm] = _start(tp, arm, env, model)
            drivers[arm].generate(16, 16)  # warm-up: the first steps compile and allocate
        for rnd in range(rounds):
            names = list(arms)
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for batch in BATCHES:
                for arm in order:
                    res = _burst(drivers[arm], batch, bursts, max_tokens)
                    if arms[arm].get("HOTLOOP_VLLM") == "0":
                        time.sleep(settle_s)  # vLLM's readers spin on for a second after their last message
                    raw[(batch, arm)].append(res)
                    say(f"  round {rnd + 1} TP={tp} batch {batch:2d} {arm:14s} {res['tok_per_s']:7.0f} tok/s "
                        f"{res['cpu_ms_per_tok']:.2f} CPU ms/tok")
    finally:
        for d in drivers.values():
            d.close()
    return raw


def summarize(raw_by_tp: dict, arms: list[str]) -> dict:
    """Per TP, batch and arm: median (min-max) tok/s and CPU ms/token, their within-round ratios to vLLM's, CPU %
    by process (median), and whether greedy outputs matched vLLM's."""
    out = {}
    for tp, raw in raw_by_tp.items():
        for batch in BATCHES:
            base = raw[(batch, arms[0])]
            for arm in arms:
                runs = raw[(batch, arm)]
                row = {k: [r[k] for r in runs] for k in ("tok_per_s", "cpu_ms_per_tok")}
                row["tok_ratio"] = [r["tok_per_s"] / b["tok_per_s"] for r, b in zip(runs, base)]
                row["cpu_ratio"] = [r["cpu_ms_per_tok"] / b["cpu_ms_per_tok"] for r, b in zip(runs, base)]
                keys = sorted(set().union(*(r["cpu_pct"] for r in runs)))
                row["cpu_pct"] = {k: statistics.median(r["cpu_pct"].get(k, 0.0) for r in runs) for k in keys}
                row["identical"] = all(r["token_ids"] == b["token_ids"] for r, b in zip(runs, base))
                out[f"TP={tp} batch={batch} {arm}"] = row
    return out


def where() -> str:
    """What computes the model: vLLM's CPU build, or the simulated device where HOTLOOP_VLLM_SIM_DEVICE (inherited
    by every engine) asks for it."""
    from hotloop.vllm.sim_device import requested

    spec = requested()
    return f"simulated device ({spec[0]:g} us + {spec[1]:g} us a token)" if spec else "CPU build"


def goals(summary: dict, tps, arm: str = "hotloop") -> list[dict]:
    """The batch goals for `arm` (median of within-round ratios to vLLM's)."""
    med = statistics.median
    on = where().split(" (")[0]
    tok = {f"TP={tp} batch {b}": med(summary[f"TP={tp} batch={b} {arm}"]["tok_ratio"]) for tp in tps for b in BATCHES}
    cpu = {f"TP={tp} batch {b}": (med(summary[f"TP={tp} batch={b} {arm}"]["cpu_ratio"]), GOALS["cpu_ratio_max"][b])
           for tp in tps for b in BATCHES}
    same = all(summary[f"TP={tp} batch={b} {arm}"]["identical"] for tp in tps for b in BATCHES)
    return [
        {"goal": f"{on}, offline batch 1 and 16: tok/s >= 1.0x vLLM's", "met": all(v >= 1.0 for v in tok.values()),
         "detail": ", ".join(f"{k} {v:.2f}" for k, v in tok.items())},
        {"goal": f"{on}, offline: CPU per token <= 0.75x vLLM's at batch 1, <= 0.9x at batch 16",
         "met": all(v <= cap for v, cap in cpu.values()),
         "detail": ", ".join(f"{k} {v:.2f}" for k, (v, _) in cpu.items())},
        {"goal": f"{on}, offline: greedy outputs identical to vLLM's", "met": same, "detail": "yes" if same else "no"},
    ]


def table(summary: dict, arms: list[str], tps) -> list[str]:
    med = statistics.median
    lines = [f"{'case':22s} {'tok/s median (min-max)':>26s} {'x vLLM':>7s} {'CPU ms/tok':>11s} {'x vLLM':>7s}  "
             "CPU % by process (front end, engine core, workers)"]
    for tp in tps:
        for b in BATCHES:
            for arm in arms:
                r = summary[f"TP={tp} batch={b} {arm}"]
                pct = r["cpu_pct"]
                procs = " / ".join(f"{pct.get(k, 0.0):.0f}" for k in ("front_end", "engine_core") +
                                   tuple(sorted(k for k in pct if k.startswith("worker"))))
                lines.append(f"TP={tp} b={b:<2d} {arm:14s} {med(r['tok_per_s']):8.0f} ({min(r['tok_per_s']):.0f}-"
                             f"{max(r['tok_per_s']):.0f}){'':>4s} {med(r['tok_ratio']):7.2f} "
                             f"{med(r['cpu_ms_per_tok']):11.2f} {med(r['cpu_ratio']):7.2f}  {procs}")
    return lines


def report(data: dict) -> str:
    """The batch rows as ``hotloop bench vllm`` prints them: a title, the table, the goals."""
    model = "vLLM's CPU build computing the model" if where() == "CPU build" else f"vLLM on the {where()}"
    lines = [f"{model}, offline LLM.generate, batch 1 and 16 ({data['max_tokens']} "
             f"tokens a request, {data['rounds']} short rounds, arms alternating burst by burst; medians, ratios "
             "within a round)"]
    lines += table(data["rows"], data["arms"], data["tps"])
    if data.get("goals"):
        lines.append(goal_lines(data["goals"]))
    return "\n".join(lines)


def run(rounds: int = 15, tps=(1, 2), arms=("vllm", "hotloop"), extra_arms: dict | None = None, bursts: int = 1,
        max_tokens: int = MAX_TOKENS, settle_s: float = 1.2, say=print) -> dict:
    from hotloop.vllm import tiny_model

    envs = {a: ARM_ENV[a] for a in arms} | dict(extra_arms or {})
    model = tiny_model.build(0)
    raw = {tp: run_tp(tp, envs, rounds, bursts, max_tokens, settle_s, model, say) for tp in tps}
    summary = summarize(raw, list(envs))
    data = {"rounds": rounds, "bursts": bursts, "max_tokens": max_tokens, "batches": list(BATCHES),
            "tps": list(tps), "arms": list(envs), "rows": summary}
    if "hotloop" in envs:
        data["goals"] = goals(summary, tps)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--arms", default="vllm,hotloop")
    ap.add_argument("--arm-env", action="append", default=[], metavar="NAME=K=V,K=V")
    ap.add_argument("--bursts", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    extra = {}
    for spec in args.arm_env:
        name, _, pairs = spec.partition("=")
        extra[name] = {"HOTLOOP_VLLM": "1"} | dict(p.split("=", 1) for p in pairs.split(",") if p)
    tps = tuple(int(x) for x in args.tp_sizes.split(","))
    data = run(args.rounds, tps, tuple(args.arms.split(",")), extra, args.bursts, args.max_tokens)
    print(report(data))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
