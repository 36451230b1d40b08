"""``hotloop bench vllm-omni``: vllm-omni 0.30.0's two-stage text pipeline (``hotloop.vllm.omni``) on vLLM's own
queue and on hotloop's, in the same run and the same process layout.

Arms (each a fresh ``AsyncOmni`` in its own driver process, ``python -m hotloop.bench.vllm.omni --driver``):
"event" (vllm-omni's event-driven orchestrator and drain, vLLM's queue), "event+hotloop" (the same with
``HOTLOOP_VLLM=1``: hotloop's queue in every stage's engine core and worker) and "legacy" (vllm-omni's default
1 ms polling orchestrator and drain, vLLM's queue).

Method: two stages of the tiny random Llama built locally (``hotloop.vllm.tiny_model``); stage 1 takes stage 0's
token ids as its prompt. After 3 warm-up requests the driver sends `requests` requests one after another (greedy,
`tokens` output tokens per stage, ``ignore_eos``), and times, per request, the first output the caller gets
(stage 1's first token) and its last: time to first output and end to end, p50 / p99 over the requests. CPU per
token: the CPU seconds of the whole process tree (every thread's schedstat) over those requests, divided by the
tokens both stages generated. Then 3 s idle: CPU of the tree, per process kind (the caller's process, the stages'
engine cores, their workers). Two hops are stamped in the caller's process: the stage-output pickup (the engine
core's output timestamp, CLOCK_MONOTONIC, to the orchestrator's thread handling it) and the drain (the orchestrator
putting a message on its output queue to the caller's event loop reading it): what a hotloop wait in the
orchestrator or in the drain could shorten. Every process that runs on hotloop's queue logs the plugin's line; the
bench reads them from the driver's log and checks that they are exactly the stages' engine cores and workers
(none in the "event" and "legacy" arms). A round runs each arm once, the first arm rotating; cells are medians
over rounds (min-max), ratios are taken within a round and their median shown. Greedy outputs are compared across
arms and rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from hotloop.bench.proc import schedstat, thread_name, tree
from hotloop.bench.report import Progress, Report, goal_lines, median_range, over_rounds, percentile, table
from hotloop.bench.vllm.processes import GLOO_LOOP_THREAD

ARMS = ("event", "event+hotloop", "legacy")
BASELINE = "event"
KINDS = ("caller", "engine_cores", "workers", "gloo", "other")


def _arm_env(arm: str) -> dict:
    from hotloop.vllm import omni

    # INFO: each process on hotloop's queue logs the plugin's line, which the bench reads
    return omni.env(hotloop=arm.endswith("+hotloop"), event_driven=not arm.startswith("legacy"),
                    base=dict(os.environ, VLLM_LOGGING_LEVEL="INFO"))


# ---- process tree ----

def kind_of(pid: int, root: int, cmd: str) -> str:
    """The process kind: the caller (the driver, where AsyncOmni and its orchestrator thread run), a stage's engine
    core, a stage's worker, or another (multiprocessing's resource tracker, ...)."""
    if pid == root:
        return "caller"
    if "Worker" in cmd:
        return "workers"
    if "EngineCore" in cmd or "Stage" in cmd:
        return "engine_cores"
    return "other"


def tree_seconds(root: int) -> dict[str, float]:
    """CPU seconds of `root` and its live descendants by process kind, from every thread's schedstat (torch's gloo
    loop threads apart: they tick in every arm, untouched by any queue)."""
    parts = dict.fromkeys(KINDS + ("tree",), 0.0)
    for pid, cmd in tree(root).items():
        kind = kind_of(pid, root, cmd)
        for tid, (ns, _waited) in schedstat(pid).items():
            parts["gloo" if thread_name(pid, tid) == GLOO_LOOP_THREAD else kind] += ns / 1e9
            parts["tree"] += ns / 1e9
    return parts


# ---- the driver (one AsyncOmni, one arm) ----

def _stamp_hops(pickups: list, drains: list) -> None:
    """Stamp the stage-output pickup and the orchestrator -> caller drain (measurement only; vllm-omni's code runs
    unchanged inside the wrappers)."""
    from vllm_omni.engine import omni_engine_base, orchestrator

    handle = orchestrator.OrchestratorBase._process_llm_stage_outputs

    async def _process(self, stage_id, replica_id, raw_outputs, *args, **kwargs):
        ts = getattr(raw_outputs, "timestamp", None)
        if ts and getattr(raw_outputs, "outputs", None):
            pickups.append((stage_id, (time.monotonic() - ts) * 1e3))
        return await handle(self, stage_id, replica_id, raw_outputs, *args, **kwargs)

    orchestrator.OrchestratorBase._process_llm_stage_outputs = _process

    init = orchestrator.OrchestratorBase.__init__
    put_at: dict[int, int] = {}

    class _StampedPut:
        def __init__(self, q):
            self._q = q

        def __getattr__(self, name):
            return getattr(self._q, name)

        async def put(self, item):
            put_at[id(item)] = time.monotonic_ns()
            return await self._q.put(item)

        def put_nowait(self, item):
            put_at[id(item)] = time.monotonic_ns()
            return self._q.put_nowait(item)

    def _init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.output_async_queue = _StampedPut(self.output_async_queue)

    orchestrator.OrchestratorBase.__init__ = _init

    def _received(msg):
        t = put_at.pop(id(msg), None)
        if t is not None:
            drains.append((time.monotonic_ns() - t) / 1e6)
        return msg

    cls = omni_engine_base.OmniEngineBase
    for name in ("get_output_blocking_async", "try_get_output_async"):  # the event-driven and the polling drain
        def wrap(fn=getattr(cls, name)):
            async def _get(self, *a, **k):
                msg = await fn(self, *a, **k)
                return _received(msg) if msg is not None else msg
            return _get

        setattr(cls, name, wrap())


def _sampling_params(tokens: int) -> list:
    """Both stages' sampling parameters: greedy, `tokens` tokens each; the last stage streams deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                           output_kind=RequestOutputKind.FINAL_ONLY),
            SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                           output_kind=RequestOutputKind.DELTA)]


async def _one_request(engine, prompt, rid, tokens: int) -> dict:
    """One request through the pipeline: time to its first output and to its end, its token ids, its outputs."""
    t0 = time.monotonic_ns()
    first = last = None
    ids, n_out = [], 0
    async for out in engine.generate({"prompt": prompt}, request_id=rid, sampling_params_list=_sampling_params(tokens)):
        now = time.monotonic_ns()
        first = first or now
        last = now
        ro = getattr(out, "request_output", None) or out
        for c in getattr(ro, "outputs", None) or []:
            ids.extend(c.token_ids)
        n_out += 1
    return {"ttfo_ms": (first - t0) / 1e6, "e2e_ms": (last - t0) / 1e6, "ids": ids, "outputs": n_out}


def _driver(args) -> int:
    import asyncio

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM and vllm-omni log to stdout: keep the protocol channel clean
    from hotloop.vllm import omni, tiny_model

    pickups, drains = [], []
    _stamp_hops(pickups, drains)
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    pipeline = omni.register_text_pipeline(2)
    tmp = tempfile.mkdtemp(prefix="hotloop-omni-")
    deploy = omni.write_deploy_yaml(os.path.join(tmp, "deploy.yaml"), pipeline, 2)
    prompts = tiny_model.prompts(args.requests + 3, seed=args.seed)

    async def main():
        engine = AsyncOmni(model=args.model, deploy_config=deploy)
        try:
            for i in range(3):
                await _one_request(engine, prompts[i], f"warm{i}", args.tokens)
            pickups.clear()
            drains.clear()
            root = os.getpid()
            c0 = tree_seconds(root)
            res = [await _one_request(engine, p, f"r{i}", args.tokens) for i, p in enumerate(prompts[3:])]
            c1 = tree_seconds(root)
            tokens = len(res) * args.tokens * 2
            t_idle = time.monotonic()
            i0 = tree_seconds(root)
            await asyncio.sleep(3.0)
            i1 = tree_seconds(root)
            dt = time.monotonic() - t_idle
            kinds = {pid: kind_of(pid, root, cmd) for pid, cmd in tree(root).items()}
            out = {"pid": root, "kinds": kinds,
                   "ttfo_ms": [r["ttfo_ms"] for r in res], "e2e_ms": [r["e2e_ms"] for r in res],
                   "cpu_s_per_1k_tok": 1000 * (c1["tree"] - c0["tree"]) / tokens,
                   "idle_pct": {k: 100 * (i1[k] - i0[k]) / dt for k in i0},
                   "pickup_ms": {str(s): [v for st, v in pickups if st == s] for s in range(2)},
                   "drain_ms": list(drains), "token_ids": [r["ids"] for r in res]}
        finally:
            engine.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
        proto.write(json.dumps(out) + "\n")

    asyncio.run(main())
    return 0


def run_arm(arm: str, model: str, requests: int, tokens: int, seed: int) -> dict:
    """One fresh AsyncOmni of `arm` in a driver process: its figures, and the pids whose log says they run on
    hotloop's queue (``on_hotloop``)."""
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.run([sys.executable, "-m", "hotloop.bench.vllm.omni", "--driver", "--model", model,
                            "--requests", str(requests), "--tokens", str(tokens), "--seed", str(seed)],
                           env=_arm_env(arm), stdout=subprocess.PIPE, stderr=log, text=True, timeout=1800,
                           start_new_session=True)
        log.seek(0)
        text = log.read()
    if os.environ.get("HOTLOOP_BENCH_VERBOSE"):
        sys.stderr.write(text)
    if p.returncode != 0 or not p.stdout.strip():
        raise RuntimeError(f"vllm-omni driver (arm {arm}) failed (code {p.returncode}); its log ends:\n"
                           + text[-4000:])
    res = json.loads(p.stdout.strip().splitlines()[-1])
    from hotloop.vllm import omni

    res["on_hotloop"] = {str(pid): v for pid, v in omni.stage_processes_on_hotloop(text).items()}
    return res


def check_arm(arm: str, res: dict) -> str:
    """'' when the processes on hotloop's queue are exactly the stages' engine cores and workers in a hotloop arm
    (none in the others); else what is wrong."""
    kinds = res["kinds"]
    stage_procs = {pid for pid, k in kinds.items() if k in ("engine_cores", "workers")}
    on = set(res["on_hotloop"])
    if not arm.endswith("+hotloop"):
        return f"{sorted(on)} run on hotloop's queue in arm {arm}" if on else ""
    if len([p for p in stage_procs if kinds[p] == "engine_cores"]) < 2 or \
            len([p for p in stage_procs if kinds[p] == "workers"]) < 2:
        return f"expected two engine cores and two workers, found {kinds}"
    missing = stage_procs - on
    return f"not on hotloop's queue: {sorted((p, kinds[p]) for p in missing)}" if missing else ""


FIGURES = {"ttfo_p50_ms": ("first output p50 ms", 1), "ttfo_p99_ms": ("first output p99 ms", 1),
           "e2e_p50_ms": ("end to end p50 ms", 1), "e2e_p99_ms": ("end to end p99 ms", 1),
           "cpu_s_per_1k_tok": ("CPU s / 1k tok", 2), "idle_tree_pct": ("idle tree %", 2),
           "pickup_p50_ms": ("pickup p50 ms", 2), "pickup_p99_ms": ("pickup p99 ms", 2),
           "drain_p50_ms": ("drain p50 ms", 2), "drain_p99_ms": ("drain p99 ms", 2)}


def figures(res: dict) -> dict:
    pick = [v for vs in res["pickup_ms"].values() for v in vs]
    return {"ttfo_p50_ms": percentile(res["ttfo_ms"], 50), "ttfo_p99_ms": percentile(res["ttfo_ms"], 99),
            "e2e_p50_ms": percentile(res["e2e_ms"], 50), "e2e_p99_ms": percentile(res["e2e_ms"], 99),
            "cpu_s_per_1k_tok": res["cpu_s_per_1k_tok"], "idle_tree_pct": res["idle_pct"]["tree"],
            "pickup_p50_ms": percentile(pick, 50), "pickup_p99_ms": percentile(pick, 99),
            "drain_p50_ms": percentile(res["drain_ms"], 50), "drain_p99_ms": percentile(res["drain_ms"], 99)}


def run(quick: bool = False, rounds: int | None = None, requests: int | None = None, tokens: int = 16,
        seed: int = 0, arms=ARMS):
    from hotloop.vllm import omni

    ok, why = omni.importable()
    if not ok:
        msg = f"skipped: {why}"
        return {"skipped": msg}, msg
    from hotloop.vllm import check_version, tiny_model

    version = check_version()
    model = tiny_model.build(seed)
    rounds = rounds or (1 if quick else 4)
    requests = requests or (4 if quick else 30)
    progress = Progress("bench vllm-omni", rounds * len(arms))
    raw = {arm: [] for arm in arms}
    reference, differ, problems = None, [], []
    for rnd in range(rounds):
        order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
        for arm in order:
            res = run_arm(arm, model, requests, tokens, seed)
            ids = res.pop("token_ids")
            reference = ids if reference is None else reference
            if ids != reference:
                differ.append(f"{arm} round {rnd + 1}")
            bad = check_arm(arm, res)
            if bad:
                problems.append(f"{arm} round {rnd + 1}: {bad}")
            res["figures"] = figures(res)
            raw[arm].append(res)
            f = res["figures"]
            progress.step(f"round {rnd + 1} {arm}: first output p50 {f['ttfo_p50_ms']:.1f} ms, e2e p50 "
                          f"{f['e2e_p50_ms']:.1f} ms, idle {f['idle_tree_pct']:.1f} %")
    progress.close()
    data = summarize(raw, arms)
    data.update({"rounds": rounds, "requests": requests, "tokens_per_stage": tokens, "vllm_version": version,
                 "vllm_omni_version": omni.vllm_omni_version(), "identical_greedy_outputs": not differ,
                 "outputs_differ": differ, "hotloop_processes_problems": problems,
                 "hotloop_processes": {arm: [len(r["on_hotloop"]) for r in raw[arm]] for arm in arms}})
    data["goals"] = goals(data)
    return data, render(data, arms)


def summarize(raw: dict, arms) -> dict:
    data = {"arms": list(arms), "per_arm": {}, "ratio": {}, "idle_by_kind": {}}
    for arm in arms:
        data["per_arm"][arm] = {k: over_rounds([r["figures"][k] for r in raw[arm]]) for k in FIGURES}
        data["idle_by_kind"][arm] = {k: over_rounds([r["idle_pct"][k] for r in raw[arm]]) for k in KINDS + ("tree",)}
        if arm != BASELINE and BASELINE in raw:
            data["ratio"][arm] = {k: over_rounds([a["figures"][k] / b["figures"][k] if b["figures"][k] else float("nan")
                                             for a, b in zip(raw[arm], raw[BASELINE])]) for k in FIGURES}
    return data


def goals(data: dict) -> list[dict]:
    r = data["ratio"].get("event+hotloop")
    out = [{"goal": "greedy outputs identical in every arm and round", "met": data["identical_greedy_outputs"],
            "detail": "yes" if data["identical_greedy_outputs"] else ", ".join(data["outputs_differ"])},
           {"goal": "every stage's engine core and worker on hotloop's queue (hotloop arm), none otherwise",
            "met": not data["hotloop_processes_problems"],
            "detail": "; ".join(data["hotloop_processes_problems"]) or "yes"}]
    if r:
        for key, limit, what in (("idle_tree_pct", 1.0, "idle CPU of the tree < 1.0x"),
                                 ("cpu_s_per_1k_tok", 1.0, "CPU per token < 1.0x"),
                                 ("ttfo_p50_ms", 1.0, "time to first output p50 <= 1.0x"),
                                 ("ttfo_p99_ms", 1.0, "time to first output p99 <= 1.0x")):
            v = r[key]["median"]
            met = v < limit if key in ("idle_tree_pct", "cpu_s_per_1k_tok") else v <= limit
            out.append({"goal": f"event+hotloop vs event: {what} (median of within-round ratios)", "met": met,
                        "detail": f"{v:.2f} ({r[key]['min']:.2f}-{r[key]['max']:.2f})"})
    return out


def render(data: dict, arms) -> Report:
    n = data["rounds"]
    keys = list(FIGURES)
    rows = [[arm] + [median_range(data["per_arm"][arm][k], FIGURES[k][1]) for k in keys] for arm in arms]
    rows += [[f"{arm}/{BASELINE}"] + [median_range(data["ratio"][arm][k], 2) for k in keys] for arm in data["ratio"]]
    parts = [table(f"vllm-omni {data['vllm_omni_version']} (vLLM {data['vllm_version']}) AsyncOmni, two text stages: "
                   f"{data['requests']} sequential requests, {data['tokens_per_stage']} greedy tokens per stage; "
                   f"median (min-max) over {n} round{'s' * (n > 1)}", ["arm"] + [FIGURES[k][0] for k in keys], rows,
                   note="pickup: a stage's output, from the engine core's timestamp to the orchestrator handling it; "
                        "drain: the orchestrator's output queue to the caller's event loop.")]
    idle_rows = [[arm] + [median_range(data["idle_by_kind"][arm][k], 2) for k in KINDS + ("tree",)] for arm in arms]
    parts.append(table("Idle CPU in the 3 s after the last request, percent of one core, by process kind",
                       ["arm", "caller (AsyncOmni, orchestrator)", "stage engine cores",
                        "stage workers (gloo apart)", "gloo loops", "other", "tree"], idle_rows))
    parts.append(goal_lines(data["goals"]))
    parts.append("Method: a fresh AsyncOmni per arm and round (event: vllm-omni's event-driven orchestrator, vLLM's "
                 "queue; event+hotloop: the same on hotloop's queue; legacy: vllm-omni's 1 ms polling loop, vLLM's "
                 "queue), 3 warm-up requests, then sequential requests; the first arm rotates each round; ratios "
                 "within a round, their median (min-max). CPU: every thread's schedstat over the requests, per "
                 "token of both stages.")
    return Report(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.omni")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 round of 4 requests (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 4; 1 with --quick)")
    ap.add_argument("--requests", type=int, default=None, help="sequential requests per arm (default 30; 4 --quick)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy output tokens per stage (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model and the prompts")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.driver:
        return _driver(args)
    data, text = run(quick=args.quick, rounds=args.rounds, requests=args.requests, tokens=args.tokens,
                     seed=args.seed)
    from hotloop.bench.report import print_result

    return print_result("vllm-omni", data, text, args.json)


if __name__ == "__main__":
    sys.exit(main())
