"""``hotloop bench vllm``: vLLM's own engine (MultiprocExecutor) on vLLM's MessageQueue and on hotloop's, in the
same run, same process layout: offline ``LLM.generate`` bursts and an online run through ``AsyncLLM``.

Method: each engine runs in a fresh driver process (``python -m hotloop.bench.vllm_bench --driver`` or
``--online-driver``) on a tiny random Llama model built locally (``hotloop.vllm.tiny_model``); the arm "vllm" runs
with ``HOTLOOP_VLLM=0``, the arm "hotloop" with ``HOTLOOP_VLLM=1`` (the plugin replaces the queue in the engine core
and every worker; the driver asks each worker which class it runs and the bench checks it). A round runs every
engine of both arms back to back, arms alternating (the order flips each round); the table shows the median and
the min-max over rounds of each figure, and the ratio hotloop / vLLM computed within each round (its median and
min-max), so a machine that slows down between rounds moves both arms.

Offline (TP=1 and TP=2): one warm-up burst, then ``bursts`` bursts of batch 1 and of batch 16 (64 output tokens
each, greedy, ``ignore_eos``); per burst, output tokens / wall time (tok/s) and CPU seconds of the whole process
tree (the driver, the engine core, the workers: utime + stime of every descendant, from /proc/<pid>/stat) per 1000
output tokens. After the last burst the tree's CPU is read over the first 3 s and over 5-8 s (percent of one core;
summed over every thread's schedstat run time, which is exact where tick-sampled utime + stime is not). Greedy token
ids must be identical across arms, rounds and layouts (asserted).

Online (the largest TP): ``AsyncLLM`` streaming, one warm-up request, then a seeded Poisson process of requests
(32 output tokens each, greedy): time to first token and inter-token latency (gaps between streamed outputs) p50
/ p99, output tokens / (first arrival to last completion), and the tree's CPU seconds per 1000 tokens.

On this machine (few cores) TP=2 binds the workers' OpenMP threads one core each (``VLLM_CPU_OMP_THREADS_BIND``
"0|1"), TP=1 to core 0; the KV cache is 1 GiB (``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time

from hotloop.bench.report import (NO_PLOT, Progress, cdf_panel, cmdline, descendants, fmt, median, percentile,
                                   process_tree_cpu_seconds, processes, pyplot, table, time_stream)

OUTPUT_TOKENS = 64
BATCHES = (1, 16)
ARMS = ("vllm", "hotloop")
BIND = {1: "0", 2: "0|1"}


# ---- process-tree CPU ----

def tree(root: int) -> dict[int, str]:
    """pid -> command line (vLLM retitles its processes: VLLM::EngineCore, VLLM::Worker_TP0, ...) of `root` and
    its live descendants."""
    found = {pid: cmdline(pid) for pid in descendants(processes(), root)}
    return {pid: line.replace(b"\0", b" ").decode(errors="replace").strip() for pid, line in found.items()
            if line is not None}


GLOO_LOOP_THREAD = "gloo_tcp_loop"  # torch's gloo transport: one per gloo device, epoll_wait with a 10 ms tick


def tree_run_seconds(root: int) -> tuple[float, float]:
    """CPU time of every thread of `root` and its live descendants, and of those that are gloo's loop threads, in
    seconds, from /proc/<pid>/task/<tid>/schedstat (nanoseconds the scheduler accounted; utime + stime are sampled
    at the clock tick, which over a few seconds of near-idle charges a whole 10 ms tick to a thread that ran
    microseconds when the tick hit it)."""
    total = gloo = 0
    for pid in tree(root):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError):
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        ns = int(f.read().split()[0])
                    total += ns
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        if f.read().strip() == GLOO_LOOP_THREAD:
                            gloo += ns
    return total / 1e9, gloo / 1e9


# ---- the driver (one engine, one arm) ----

def _check_worker_queue(_worker=None):
    """Runs in each worker (collective_rpc): the MessageQueue class vLLM's executor module uses there."""
    mod = sys.modules["vllm.v1.executor.multiproc_executor"]
    return f"{mod.MessageQueue.__module__}.{mod.MessageQueue.__qualname__}"


def _driver(args) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep the protocol channel clean

    def say(**msg):
        proto.write(json.dumps(msg) + "\n")

    from vllm import LLM, SamplingParams

    from hotloop.vllm import tiny_model

    llm = LLM(model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend="mp", dtype="float32",
              max_model_len=512, max_num_seqs=16, seed=0, enforce_eager=True, gpu_memory_utilization=0.5)
    queue_class = sorted(set(llm.collective_rpc(_check_worker_queue)))
    say(ready=True, pid=os.getpid(), queue_class=queue_class)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", OUTPUT_TOKENS), ignore_eos=True)
            prompts = tiny_model.prompts(cmd["batch"], seed=cmd.get("seed", 0))
            t0 = time.perf_counter()
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            except Exception as e:  # reported (tests read it); the engine is unusable after most errors
                say(error=f"{type(e).__module__}.{type(e).__qualname__}", message=str(e)[:500],
                    after_s=time.perf_counter() - t0)
                continue
            wall = time.perf_counter() - t0
            say(wall_s=wall, token_ids=[list(o.outputs[0].token_ids) for o in outs])
        elif cmd["cmd"] == "exit":
            break
    say(bye=True)
    return 0


def _env(tp: int, arm: str) -> dict:
    """The environment of a driver process of `arm` at tensor parallel size `tp`."""
    return dict(os.environ, HOTLOOP_VLLM="1" if arm == "hotloop" else "0", VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_CPU_OMP_THREADS_BIND=BIND.get(tp, "auto"), TOKENIZERS_PARALLELISM="false",
                VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                # lets the driver ask each worker which queue class it runs (a function sent by collective_rpc)
                VLLM_ALLOW_INSECURE_SERIALIZATION="1")


class Driver:
    """The bench side of a driver process: start, send bursts, read results, stop."""

    def __init__(self, tp: int, arm: str, model: str, env_extra: dict | None = None):
        env = {**_env(tp, arm), **(env_extra or {})}
        self.tp, self.arm = tp, arm
        self.log = open(os.devnull, "w") if not os.environ.get("HOTLOOP_BENCH_VERBOSE") else None
        self.proc = subprocess.Popen([sys.executable, "-m", "hotloop.bench.vllm_bench", "--driver", "--tp", str(tp),
                                      "--model", model], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, start_new_session=True)
        ready = self._read()
        self.pid = self.proc.pid
        self.queue_class = ready["queue_class"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"vLLM driver (TP={self.tp}, arm {self.arm}) exited with code {rc} before answering; "
                               "rerun with HOTLOOP_BENCH_VERBOSE=1 to see its log")
        return json.loads(line)

    def generate(self, batch: int, max_tokens: int = OUTPUT_TOKENS) -> dict:
        """One burst: {"wall_s", "token_ids", "cpu_s"}, or {"error", "message", "after_s"} when vLLM raised."""
        c0 = process_tree_cpu_seconds(self.pid)
        self.proc.stdin.write(json.dumps({"cmd": "generate", "batch": batch, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        out["cpu_s"] = process_tree_cpu_seconds(self.pid) - c0
        return out

    def processes(self) -> dict[int, str]:
        """The driver's process tree: pid -> command line."""
        return tree(self.pid)

    def idle_cpu(self, windows=((0.0, 3.0), (5.0, 8.0))) -> list[tuple[float, float]]:
        """CPU of the tree, and of its gloo loop threads, in percent of one core over each window (seconds after
        now)."""
        t0 = time.monotonic()
        res = []
        for start, end in windows:
            time.sleep(max(0.0, t0 + start - time.monotonic()))
            (all0, gloo0), w0 = tree_run_seconds(self.pid), time.monotonic()
            time.sleep(max(0.0, t0 + end - time.monotonic()))
            all1, gloo1 = tree_run_seconds(self.pid)
            dt = time.monotonic() - w0
            res.append((100.0 * (all1 - all0) / dt, 100.0 * (gloo1 - gloo0) / dt))
        return res

    def close(self) -> dict[int, str]:
        """Stop the driver; then SIGKILL whatever of its process group outlived it (a vLLM worker can: see
        docs/vllm.md) and return those stragglers (pid -> command line)."""
        tracked = self.processes()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        def left():
            found = {}
            for pid, cmd in tracked.items():
                try:
                    if pid != self.proc.pid and os.getpgid(pid) == self.proc.pid:
                        found[pid] = cmd
                except OSError:
                    continue
            return found

        deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits a moment after its clients
        while (stragglers := left()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            if f is not None:
                f.close()
        return stragglers


# ---- the benchmark ----

def _one_engine(tp: int, arm: str, model: str, bursts: int) -> dict:
    d = Driver(tp, arm, model)
    try:
        _check_queue_class(arm, d.queue_class)
        d.generate(BATCHES[-1])  # warm-up
        res = {}
        for batch in BATCHES:
            runs = [d.generate(batch) for _ in range(bursts)]
            tokens = sum(len(t) for r in runs for t in r["token_ids"])
            res[batch] = {"tok_per_s": tokens / sum(r["wall_s"] for r in runs),
                          "cpu_s_per_1k_tok": 1000 * sum(r["cpu_s"] for r in runs) / tokens,
                          "token_ids": runs[0]["token_ids"]}
        (res["idle_0_3_pct"], res["idle_0_3_gloo_pct"]), (res["idle_5_8_pct"], _) = d.idle_cpu()
        return res
    finally:
        d.close()


def _check_queue_class(arm: str, found: list[str]) -> None:
    want = "hotloop.vllm.message_queue.MessageQueue" if arm == "hotloop" else \
        "vllm.distributed.device_communicators.shm_broadcast.MessageQueue"
    if found != [want]:
        raise RuntimeError(f"arm {arm}: the workers use {found}, expected {want}")


def _stats(xs: list[float]) -> dict:
    """median, min, max of one figure over the rounds."""
    return {"median": median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def _ratios(hot: list[float], own: list[float]) -> dict:
    """hotloop / vLLM per round (the arms of a round ran back to back), summarized as _stats."""
    return _stats([h / o if o else math.nan for h, o in zip(hot, own)])


def _cell(st: dict, digits: int) -> str:
    return f"{fmt(st['median'], digits)} ({fmt(st['min'], digits)}-{fmt(st['max'], digits)})"


def _summarize(per_arm: dict[str, list[dict]], keys: dict[str, int]) -> tuple[dict, list[list[str]]]:
    """per_arm: arm -> one dict of figures per round. Returns the record (per arm, and the ratio) and the table
    rows for `keys` (figure -> digits)."""
    rec = {arm: {k: _stats([r[k] for r in runs]) for k in keys} for arm, runs in per_arm.items()}
    rec["ratio"] = {k: _ratios([r[k] for r in per_arm["hotloop"]], [r[k] for r in per_arm["vllm"]]) for k in keys}
    rows = [[arm] + [_cell(rec[arm][k], d) for k, d in keys.items()] for arm in ARMS]
    rows.append(["hotloop/vLLM"] + [_cell(rec["ratio"][k], 2) for k in keys])
    return rec, rows


def _above(rec: dict, key: str) -> bool:
    """hotloop's median above vLLM's by more than the spread (the larger half-range of the two arms)."""
    spread = max((rec[a][key]["max"] - rec[a][key]["min"]) / 2 for a in ARMS)
    return rec["hotloop"][key]["median"] - rec["vllm"][key]["median"] > spread


def run(quick: bool = False, rounds: int | None = None, tps=(1, 2), online: bool = True, seed: int = 0,
        plot_path: str | None = "hotloop-bench-vllm.png"):
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a vLLM that fails to import
        msg = f"skipped: vLLM is not importable here ({type(e).__name__}: {e}); pip install \"hotloop[vllm]\""
        return {"skipped": msg}, msg
    from hotloop.vllm import SUPPORTED_VLLM_VERSIONS, check_version, tiny_model

    version = check_version()
    model = tiny_model.build(seed)
    rounds = rounds or (1 if quick else 5)
    bursts = 1 if quick else 2
    online_tp = max(tps)
    load = OnlineLoad(*((24, 4.0) if quick else (64, 4.0)), seed=seed)
    progress = Progress("bench vllm", rounds * (len(tps) + online) * len(ARMS))
    raw = {(tp, arm): [] for tp in tps for arm in ARMS}
    raw_online = {arm: [] for arm in ARMS}
    reference = {}
    for rnd in range(rounds):
        order = ARMS if rnd % 2 == 0 else ARMS[::-1]  # alternate which arm goes first
        for tp in tps:
            for arm in order:
                res = _one_engine(tp, arm, model, bursts)
                for batch in BATCHES:
                    ids = res[batch].pop("token_ids")
                    ref = reference.setdefault(batch, ids)
                    if ids != ref:
                        raise AssertionError(f"greedy outputs differ: TP={tp}, arm {arm}, round {rnd}, batch {batch}")
                raw[(tp, arm)].append(res)
                progress.step(f"round {rnd + 1} TP={tp} {arm}: {res[1]['tok_per_s']:.0f} / "
                              f"{res[16]['tok_per_s']:.0f} tok/s, idle {res['idle_0_3_pct']:.1f} %")
        if online:
            for arm in order:
                res = run_online(online_tp, arm, model, load)
                raw_online[arm].append(res)
                progress.step(f"round {rnd + 1} online TP={online_tp} {arm}: TTFT p50 {res['ttft_p50_ms']:.1f} ms, "
                              f"ITL p50 {res['itl_p50_ms']:.2f} ms, {res['tok_per_s']:.0f} tok/s")
    progress.close()

    data = {"vllm_version": version, "supported": list(SUPPORTED_VLLM_VERSIONS), "rounds": rounds, "bursts": bursts,
            "output_tokens": OUTPUT_TOKENS, "identical_greedy_outputs": True, "offline": {}}
    idle_keys = ("idle_0_3_pct", "idle_0_3_gloo_pct", "idle_5_8_pct")
    keys = {"tok_per_s": 0, "cpu_s_per_1k_tok": 2, **{k: 1 for k in idle_keys}}
    rows = []
    for tp in tps:
        for batch in BATCHES:
            per_arm = {arm: [{**r[batch], **{k: r[k] for k in idle_keys}} for r in raw[(tp, arm)]] for arm in ARMS}
            rec, arm_rows = _summarize(per_arm, keys)
            data["offline"][f"tp{tp}/batch{batch}"] = rec
            rows += [[f"TP={tp} batch {batch:>2} {r[0]}"] + r[1:] for r in arm_rows]
    text = table(
        f"vLLM {version} offline LLM.generate on vLLM's MessageQueue vs hotloop's; tiny Llama, {OUTPUT_TOKENS} "
        f"output tokens, greedy; median (min-max) over {rounds} round{'s' * (rounds > 1)} (fresh engines, arms "
        f"alternating), {bursts} burst{'s' * (bursts > 1)} per batch per round",
        ["layout / batch / queue", "tok/s", "CPU s / 1k tok", "idle CPU % 0-3 s", "of it gloo loops",
         "idle CPU % 5-8 s"], rows,
        note="CPU: the whole process tree (driver, engine core, workers), utime + stime from /proc. Idle: after "
             "the last burst, percent of one core, from every thread's schedstat (per engine, so the same in both "
             "batch rows); 'of it gloo loops': torch's gloo transport threads (gloo_tcp_loop, one per gloo device "
             "in vLLM's workers, each waking every 10 ms in epoll_wait), which neither queue touches. "
             "hotloop/vLLM: the ratio within each round, median (min-max). Greedy outputs identical across arms: "
             "yes (asserted).")
    online_keys = {"ttft_p50_ms": 1, "ttft_p99_ms": 1, "itl_p50_ms": 2, "itl_p99_ms": 2, "tok_per_s": 0,
                   "cpu_s_per_1k_tok": 2}
    if online:
        rec, arm_rows = _summarize(raw_online, online_keys)
        data["online"] = {"tp": online_tp, "requests": load.n, "rate_per_s": load.rate, "seed": load.seed,
                          "output_tokens": ONLINE_TOKENS, f"tp{online_tp}": rec}
        text += "\n\n" + table(
            f"vLLM AsyncLLM at TP={online_tp}, Poisson arrivals {load.rate:g} req/s (seed {load.seed}), {load.n} "
            f"requests x {ONLINE_TOKENS} output tokens; median (min-max) over {rounds} round{'s' * (rounds > 1)}",
            ["queue", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "tok/s", "CPU s / 1k tok"],
            arm_rows, note="tok/s: output tokens / (first arrival to last completion); CPU: the process tree.")
    data["goals"] = _goals(data, tps)
    text += "\n\n" + "\n".join(f"goal {g['goal']}: {'met' if g['met'] else 'NOT met'} ({g['detail']})"
                                 for g in data["goals"])
    if plot_path:
        text += "\n" + _plot(data, raw_online, plot_path)
    return data, text


def _goals(data: dict, tps) -> list[dict]:
    off = data["offline"]
    idle = {tp: off[f"tp{tp}/batch1"]["hotloop"]["idle_0_3_pct"]["median"] for tp in tps}
    gloo = {tp: off[f"tp{tp}/batch1"]["hotloop"]["idle_0_3_gloo_pct"]["median"] for tp in tps}
    cpu = {row: rec["ratio"]["cpu_s_per_1k_tok"]["max"] for row, rec in off.items()}
    if "online" in data:
        cpu["online"] = data["online"][f"tp{data['online']['tp']}"]["ratio"]["cpu_s_per_1k_tok"]["max"]
    goals = [{"goal": "idle CPU of the tree 0-3 s after a burst <= 1 % of a core (hotloop, median)",
              "met": all(v <= 1.0 for v in idle.values()),
              "detail": ", ".join(f"TP={tp}: {v:.1f} %, of it gloo's loop threads {gloo[tp]:.1f} %"
                                  for tp, v in idle.items())},
             {"goal": "CPU per 1000 tokens lower than vLLM's in every row (every round)",
              "met": all(v < 1.0 for v in cpu.values()),
              "detail": "largest hotloop/vLLM ratio per row: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())}]
    if 2 in tps:
        rec = off["tp2/batch1"]
        goals.append({"goal": "TP=2 batch 1 tok/s above vLLM's by more than the spread",
                      "met": _above(rec, "tok_per_s"),
                      "detail": f"hotloop {_cell(rec['hotloop']['tok_per_s'], 0)} vs vLLM "
                                f"{_cell(rec['vllm']['tok_per_s'], 0)}"})
    return goals


def _plot(data: dict, raw_online: dict, path: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_PLOT
    online = "online" in data
    fig, axes = plt.subplots(1, 4 if online else 2, figsize=(20 if online else 11, 4.5))
    labels = list(data["offline"])
    for ax, key, title in ((axes[0], "tok_per_s", "throughput (offline)"),
                           (axes[1], "cpu_s_per_1k_tok", "CPU s per 1000 tokens (offline)")):
        for i, arm in enumerate(ARMS):
            st = [data["offline"][row][arm][key] for row in labels]
            xs = [j + (i - 0.5) * 0.4 for j in range(len(labels))]
            ax.bar(xs, [s["median"] for s in st], width=0.4, label=arm,
                   yerr=[[s["median"] - s["min"] for s in st], [s["max"] - s["median"] for s in st]], capsize=3)
        ax.set_xticks(range(len(labels)), [r.replace("/", " ") for r in labels], fontsize=8)
        ax.set(title=title + ", median, min-max")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    if online:
        for ax, key, title in ((axes[2], "ttft_ms", "time to first token (online, Poisson)"),
                               (axes[3], "itl_ms", "inter-token latency (online, Poisson)")):
            cdf_panel(ax, {arm: [x for r in raw_online[arm] for x in r[key]] for arm in ARMS}, title + ", all rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plotted to {path}"


# ---- online: AsyncLLM with Poisson arrivals ----

ONLINE_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class OnlineLoad:
    n: int  # requests
    rate: float  # mean arrivals per second
    seed: int = 0

    def arrivals(self) -> list[float]:
        """Seconds after the start at which each request arrives (a seeded Poisson process)."""
        rng, t, out = random.Random(self.seed), 0.0, []
        for _ in range(self.n):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out


def _online_driver(args) -> int:
    import asyncio

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep the protocol channel clean
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hotloop.vllm import tiny_model

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend="mp", dtype="float32",
            max_model_len=512, max_num_seqs=16, seed=0, enforce_eager=True))
        try:
            queue_class = sorted(set(await engine.collective_rpc(_check_worker_queue)))
            params = SamplingParams(temperature=0.0, max_tokens=ONLINE_TOKENS, ignore_eos=True)
            load = OnlineLoad(args.n, args.rate, args.seed)
            prompts = tiny_model.prompts(load.n, seed=load.seed)

            async def one(i, at, t_start):
                await asyncio.sleep(max(0.0, t_start + at - time.perf_counter()))
                t0 = time.perf_counter()
                first, gaps, outs = await time_stream(engine.generate(prompts[i], params, request_id=f"r{i}-{at}"), t0)
                return first, gaps, len(outs[-1].outputs[0].token_ids)

            await one(0, 0.0, time.perf_counter())  # warm-up
            c0, t_start = process_tree_cpu_seconds(os.getpid()), time.perf_counter()
            res = await asyncio.gather(*(one(i, at, t_start) for i, at in enumerate(load.arrivals())))
            wall, cpu = time.perf_counter() - t_start, process_tree_cpu_seconds(os.getpid()) - c0
        finally:
            engine.shutdown()
        ttft = [r[0] * 1e3 for r in res]
        itl = [g * 1e3 for r in res for g in r[1]]
        tokens = sum(r[2] for r in res)
        proto.write(json.dumps({
            "queue_class": queue_class, "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99), "tok_per_s": tokens / wall,
            "cpu_s_per_1k_tok": 1000 * cpu / tokens, "tokens": tokens, "ttft_ms": ttft, "itl_ms": itl}) + "\n")

    asyncio.run(main())
    return 0


def run_online(tp: int, arm: str, model: str, load: OnlineLoad) -> dict:
    """One AsyncLLM engine of `arm` under `load` in a fresh driver process: its figures (and the raw TTFT / ITL
    samples in ms)."""
    p = subprocess.run([sys.executable, "-m", "hotloop.bench.vllm_bench", "--online-driver", "--tp", str(tp),
                        "--model", model, "--n", str(load.n), "--rate", str(load.rate), "--seed", str(load.seed)],
                       env=_env(tp, arm), stdout=subprocess.PIPE, stderr=None if os.environ.get(
                           "HOTLOOP_BENCH_VERBOSE") else subprocess.DEVNULL, text=True, timeout=900,
                       start_new_session=True)
    if p.returncode != 0 or not p.stdout.strip():
        raise RuntimeError(f"online driver TP={tp} arm {arm} failed (code {p.returncode}); rerun with "
                           "HOTLOOP_BENCH_VERBOSE=1 to see its log")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    _check_queue_class(arm, res.pop("queue_class"))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm_bench")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--online-driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=24, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=4.0, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 round, 1 burst per batch, 24 online requests")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5; 1 with --quick)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, the prompts and the arrivals")
    ap.add_argument("--no-online", action="store_true", help="leave out the AsyncLLM Poisson run")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH", default="hotloop-bench-vllm.png")
    args = ap.parse_args(argv)
    if args.driver:
        return _driver(args)
    if args.online_driver:
        return _online_driver(args)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    data, text = run(quick=args.quick, rounds=args.rounds, online=not args.no_online, seed=args.seed,
                     plot_path=args.plot)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
