"""``hotloop bench vllm``: vLLM's own engine (offline ``LLM.generate``, MultiprocExecutor) on vLLM's MessageQueue
and on hotloop's, in the same run, same process layout.

Method: each (tensor parallel size, arm) gets a fresh driver process (``python -m hotloop.bench.vllm_bench
--driver``) that builds ``vllm.LLM`` on a tiny random Llama model built locally (``hotloop.vllm.tiny_model``);
the arm "vllm" runs with ``HOTLOOP_VLLM=0``, the arm "hotloop" with ``HOTLOOP_VLLM=1`` (the plugin replaces the
queue in the engine core and every worker; the driver checks that it did). Arms alternate (their order flips
each round) and every round starts fresh engines. In each engine: one warm-up burst, then ``bursts`` bursts of
batch 1 and of batch 16 (64 output tokens each, greedy, ``ignore_eos``); per burst: output tokens / wall time
(tok/s) and CPU seconds of the whole process tree (the driver, the engine core, the workers: utime + stime of
every descendant, from /proc/<pid>/stat) per 1000 output tokens. After the last burst the tree's CPU is read
over the first 3 s and over 5-8 s (percent of one core). Greedy token ids must be identical across arms, rounds
and layouts (asserted). The table shows medians over rounds and the spread (half the range).

On this machine (few cores) TP=2 binds the workers' OpenMP threads one core each (``VLLM_CPU_OMP_THREADS_BIND``
"0|1"), TP=1 to core 0; the KV cache is 1 GiB (``VLLM_CPU_KVCACHE_SPACE``).

``--online`` adds a run through vLLM's async engine (``AsyncLLM``) with Poisson arrivals: TTFT and inter-token
latency p50 / p99 per arm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time

from hotloop.bench.report import (Progress, fmt, median, percentile, process_tree_cpu_seconds, table,
                                   time_stream)

OUTPUT_TOKENS = 64
BATCHES = (1, 16)
ARMS = ("vllm", "hotloop")
BIND = {1: "0", 2: "0|1"}


# ---- process-tree CPU ----

def tree(root: int) -> dict[int, str]:
    """pid -> command line (vLLM retitles its processes: VLLM::EngineCore, VLLM::Worker_TP0, ...) of `root` and
    its live descendants."""
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        stack.extend(c for c, pp in parent.items() if pp == pid)
    return found


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


class Driver:
    """The bench side of a driver process: start, send bursts, read results, stop."""

    def __init__(self, tp: int, arm: str, model: str, env_extra: dict | None = None):
        env = dict(os.environ)
        env.update(HOTLOOP_VLLM="1" if arm == "hotloop" else "0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=BIND.get(tp, "auto"), TOKENIZERS_PARALLELISM="false",
                   VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   # lets the driver ask each worker which queue class it runs (a function sent by collective_rpc)
                   VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        env.update(env_extra or {})
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

    def idle_cpu(self, windows=((0.0, 3.0), (5.0, 8.0))) -> list[float]:
        """CPU of the tree (percent of one core) over each window, seconds after now."""
        t0 = time.monotonic()
        res = []
        for start, end in windows:
            time.sleep(max(0.0, t0 + start - time.monotonic()))
            c0, w0 = process_tree_cpu_seconds(self.pid), time.monotonic()
            time.sleep(max(0.0, t0 + end - time.monotonic()))
            res.append(100.0 * (process_tree_cpu_seconds(self.pid) - c0) / (time.monotonic() - w0))
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
        want = "hotloop.vllm.message_queue.MessageQueue" if arm == "hotloop" else \
            "vllm.distributed.device_communicators.shm_broadcast.MessageQueue"
        if d.queue_class != [want]:
            raise RuntimeError(f"arm {arm}: the workers use {d.queue_class}, expected {want}")
        d.generate(BATCHES[-1])  # warm-up
        res = {}
        for batch in BATCHES:
            runs = [d.generate(batch) for _ in range(bursts)]
            tokens = sum(len(t) for r in runs for t in r["token_ids"])
            res[batch] = {"tok_per_s": tokens / sum(r["wall_s"] for r in runs),
                          "cpu_s_per_1k_tok": 1000 * sum(r["cpu_s"] for r in runs) / tokens,
                          "token_ids": runs[0]["token_ids"]}
        res["idle_0_3_pct"], res["idle_5_8_pct"] = d.idle_cpu()
        return res
    finally:
        d.close()


def _spread(xs):
    return (max(xs) - min(xs)) / 2 if xs else math.nan


def run(quick: bool = False, rounds: int | None = None, tps=(1, 2), online: bool = False, seed: int = 0):
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
    progress = Progress("bench vllm", rounds * len(tps) * len(ARMS))
    raw = {(tp, arm): [] for tp in tps for arm in ARMS}
    reference = {}
    for rnd in range(rounds):
        for tp in tps:
            order = ARMS if rnd % 2 == 0 else ARMS[::-1]
            for arm in order:
                res = _one_engine(tp, arm, model, bursts)
                for batch in BATCHES:
                    ids = res[batch].pop("token_ids")
                    ref = reference.setdefault(batch, ids)
                    if ids != ref:
                        raise AssertionError(f"greedy outputs differ: TP={tp}, arm {arm}, round {rnd}, batch {batch}")
                raw[(tp, arm)].append(res)
                progress.step(f"TP={tp} {arm}: {res[1]['tok_per_s']:.0f} / {res[16]['tok_per_s']:.0f} tok/s, "
                              f"idle {res['idle_0_3_pct']:.1f} %")
    progress.close()

    data = {"vllm_version": version, "supported": list(SUPPORTED_VLLM_VERSIONS), "rounds": rounds, "bursts": bursts,
            "output_tokens": OUTPUT_TOKENS, "identical_greedy_outputs": True, "rows": {}}
    rows = []
    for tp in tps:
        for batch in BATCHES:
            for arm in ARMS:
                runs = raw[(tp, arm)]
                tok = [r[batch]["tok_per_s"] for r in runs]
                cpu = [r[batch]["cpu_s_per_1k_tok"] for r in runs]
                i03 = [r["idle_0_3_pct"] for r in runs]
                i58 = [r["idle_5_8_pct"] for r in runs]
                rec = {"tok_per_s": median(tok), "tok_per_s_spread": _spread(tok),
                       "cpu_s_per_1k_tok": median(cpu), "cpu_s_per_1k_tok_spread": _spread(cpu),
                       "idle_0_3_pct": median(i03), "idle_0_3_pct_spread": _spread(i03),
                       "idle_5_8_pct": median(i58), "idle_5_8_pct_spread": _spread(i58),
                       "runs": {"tok_per_s": tok, "cpu_s_per_1k_tok": cpu, "idle_0_3_pct": i03, "idle_5_8_pct": i58}}
                data["rows"][f"tp{tp}/batch{batch}/{arm}"] = rec
                rows.append([f"TP={tp} batch {batch:>2} {arm}",
                             f"{fmt(rec['tok_per_s'], 0)} ±{fmt(rec['tok_per_s_spread'], 0)}",
                             f"{fmt(rec['cpu_s_per_1k_tok'], 2)} ±{fmt(rec['cpu_s_per_1k_tok_spread'], 2)}",
                             f"{fmt(rec['idle_0_3_pct'], 1)} ±{fmt(rec['idle_0_3_pct_spread'], 1)}",
                             f"{fmt(rec['idle_5_8_pct'], 1)} ±{fmt(rec['idle_5_8_pct_spread'], 1)}"])
    text = table(
        f"vLLM {version} offline LLM.generate on vLLM's MessageQueue vs hotloop's; tiny Llama, {OUTPUT_TOKENS} "
        f"output tokens, greedy; medians ± half-range over {rounds} round{'s' * (rounds > 1)} (fresh engines, "
        f"arms alternating), {bursts} burst{'s' * (bursts > 1)} per batch per round",
        ["layout / batch / queue", "tok/s", "CPU s / 1k tok", "idle CPU % 0-3 s", "idle CPU % 5-8 s"], rows,
        note="CPU: the whole process tree (driver, engine core, workers), utime + stime from /proc. Idle: after "
             "the last burst, percent of one core. Greedy outputs identical across arms: yes (asserted).")
    if online:
        on = run_online(model, tps=(max(tps),), quick=quick)
        data["online"] = on
        text += "\n\n" + _online_table(on)
    return data, text


# ---- online: AsyncLLM with Poisson arrivals ----

def _online_driver(args) -> int:
    import asyncio

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hotloop.vllm import tiny_model

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend="mp", dtype="float32",
            max_model_len=512, max_num_seqs=16, seed=0, enforce_eager=True))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = tiny_model.prompts(args.n)

        async def one(i, delay):
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            first, gaps, _ = await time_stream(engine.generate(prompts[i], params, request_id=f"r{i}"), t0)
            return first, gaps

        await one(0, 0)  # warm-up
        rng = random.Random(1)
        t, delays = 0.0, []
        for _ in range(args.n):
            t += rng.expovariate(args.rate)
            delays.append(t)
        res = await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
        engine.shutdown()
        ttft = [r[0] for r in res]
        itl = [g for r in res for g in r[1]]
        proto.write(json.dumps({"ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
                                "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3})
                    + "\n")

    asyncio.run(main())
    return 0


def run_online(model: str, tps=(2,), quick: bool = False) -> dict:
    n, rate = (24, 4.0) if quick else (64, 4.0)
    out = {}
    for tp in tps:
        for arm in ARMS:
            env = dict(os.environ, HOTLOOP_VLLM="1" if arm == "hotloop" else "0", VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND=BIND.get(tp, "auto"), TOKENIZERS_PARALLELISM="false",
                       VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
            p = subprocess.run([sys.executable, "-m", "hotloop.bench.vllm_bench", "--online-driver", "--tp", str(tp),
                                "--model", model, "--n", str(n), "--rate", str(rate), "--max-tokens", "32"],
                               env=env, stdout=subprocess.PIPE, stderr=None if os.environ.get(
                                   "HOTLOOP_BENCH_VERBOSE") else subprocess.DEVNULL, text=True, timeout=900)
            if p.returncode != 0 or not p.stdout.strip():
                raise RuntimeError(f"online driver TP={tp} arm {arm} failed (code {p.returncode}); rerun with "
                                   "HOTLOOP_BENCH_VERBOSE=1")
            out[f"tp{tp}/{arm}"] = {**json.loads(p.stdout.strip().splitlines()[-1]), "requests": n, "rate": rate}
            print(f"[bench vllm] online TP={tp} {arm} done", file=sys.stderr, flush=True)
    return out


def _online_table(on: dict) -> str:
    rows = [[k, fmt(v["ttft_p50_ms"], 1), fmt(v["ttft_p99_ms"], 1), fmt(v["itl_p50_ms"], 2), fmt(v["itl_p99_ms"], 2)]
            for k, v in on.items()]
    first = next(iter(on.values()))
    return table(f"vLLM AsyncLLM, Poisson arrivals {first['rate']:g} req/s, {first['requests']} requests x 32 output "
                 "tokens (one run per arm)", ["layout / queue", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                                              "ITL p99 ms"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm_bench")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--online-driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="1 round, 1 burst per batch")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--online", action="store_true", help="also the AsyncLLM Poisson run (TP=2)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.driver:
        return _driver(args)
    if args.online_driver:
        return _online_driver(args)
    data, text = run(quick=args.quick, rounds=args.rounds, online=args.online)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
