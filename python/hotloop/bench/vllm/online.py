"""``hotloop bench vllm --device sim --online``: the simulated device's shapes through vLLM's own server and client,
``vllm serve`` loaded by ``vllm bench serve`` (both through ``python -m hotloop.vllm.launch`` on the CPU build), so
the latency figures are vLLM's own.

Method: per round, per TP size and arm (``arms.SIM_ARMS``, the arm that goes first rotating each round), a
fresh ``vllm serve`` of the tiny model on the simulated device (``HOTLOOP_VLLM_SIM_DEVICE``), the arm's environment
(``arms.arm_env``), ``--enforce-eager``, at most 16 sequences. Each shape (``arms.shapes(quick, "sim")``) is
one ``vllm bench serve`` run of vLLM's random dataset (fixed lengths, seed 0, ``--ignore-eos``): Poisson arrivals at
the shape's rate (all at once where it is 0; decode at most 16 concurrent, single 1). Per shape, from vLLM's result
file: req/s, output tok/s, TTFT p50 / p99, ITL p50 / p99; from this harness: the host CPU of each server process
(every thread's schedstat) over the client's run, in percent of one core: front end (the API server), engine core,
each worker. After the last shape, 3 s of idle CPU of the server's tree. Generated texts are compared across arms
and rounds per shape (``--save-detailed``). Cells: median (min-max) over rounds; ratios within a round.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from hotloop.bench.proc import tree
from hotloop.bench.report import Progress, Report, fmt, goal_lines, median, median_range, over_rounds, table
from hotloop.bench.vllm.arms import SIM_ARMS, arm_env, compare_outputs, cpu_rows, identical_goal, shapes, sim_spec
from hotloop.bench.vllm.processes import IDLE_PARTS, cpu_by_process, idle_cpu
from hotloop.testing import cpu_cgroup

FIGURES = {"req_per_s": ("req/s", 1), "tok_per_s": ("tok/s", 0), "ttft_p50_ms": ("TTFT p50 ms", 1),
           "ttft_p99_ms": ("TTFT p99 ms", 1), "itl_p50_ms": ("ITL p50 ms", 2), "itl_p99_ms": ("ITL p99 ms", 2),
           "host_cpu_pct": ("engine core + workers CPU %", 0), "front_end_pct": ("front end CPU %", 0)}
_LOG = None if os.environ.get("HOTLOOP_BENCH_VERBOSE") else subprocess.DEVNULL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args) -> list[str]:
    return [sys.executable, "-m", "hotloop.vllm.launch", *args]


class Server:
    """One ``vllm serve`` of `model` for `arm` at TP `tp` on the simulated device."""

    def __init__(self, tp: int, arm: str, model: str, start_timeout_s: float = 300.0, sync: bool = False):
        self.tp, self.arm, self.model, self.port = tp, arm, model, _free_port()
        env = arm_env(tp, arm, "sim")
        env.pop("HOTLOOP_VLLM_TIMELINE", None)  # vLLM's own figures, nothing of hotloop's added to the arms
        env.pop("HOTLOOP_VLLM_READ_CPU", None)
        self.proc = subprocess.Popen(cpu_cgroup.contained(  # the pod regime: the server born in the cgroup
            _launch("serve", model, "--host", "127.0.0.1", "--port", str(self.port), "--tensor-parallel-size",
                    str(tp), "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
                    "--enforce-eager", "--seed", "0", "--distributed-executor-backend", "mp",
                    *(["--no-async-scheduling"] if sync else []))),
            env=env, stdout=_LOG, stderr=_LOG, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vllm serve (TP={tp}, arm {arm}) did not come up (exit code "
                                   f"{self.proc.returncode}); rerun with HOTLOOP_BENCH_VERBOSE=1 to see its log")
            time.sleep(0.5)  # start-up only: the server answers /health once its engine is ready

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def bench(self, shape, seed: int, out_dir: str) -> dict:
        """One ``vllm bench serve`` run of `shape`: vLLM's result, the server's CPU by process, the texts."""
        name = f"{shape.name}.json"
        rate = "inf" if shape.rate <= 0 else str(shape.rate)
        extra = []
        if shape.rate <= 0:
            extra = ["--max-concurrency", str(min(shape.n, 16))]
        cmd = _launch("bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{self.port}",
                      "--model", self.model, "--dataset-name", "random", "--random-input-len", str(shape.prompt_tokens),
                      "--random-output-len", str(shape.output_tokens), "--random-range-ratio", "0",
                      "--num-prompts", str(shape.n), "--request-rate", rate, "--seed", str(seed), "--ignore-eos",
                      "--temperature", "0", "--save-result", "--save-detailed", "--result-dir", out_dir,
                      "--result-filename", name, *extra)
        # the server's CPU over the client's main run only (not its imports, nor its first test request): from the
        # line vLLM's client prints as it starts the run to the line that opens its result
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1"))
        k0 = k1 = throttled = None
        group = os.environ.get(cpu_cgroup.ENV)  # the pod regime: the server's processes share a CPU quota
        lines = []
        for line in client.stdout:
            lines.append(line)
            if k0 is None and line.startswith("Starting main benchmark run"):
                k0, t0 = cpu_by_process(self.proc.pid), time.monotonic()
                g0 = cpu_cgroup.cpu_stat(group) if group else None
            elif k0 is not None and k1 is None and "Serving Benchmark Result" in line:
                k1, span = cpu_by_process(self.proc.pid), time.monotonic() - t0
                throttled = cpu_cgroup.stat_delta(g0, cpu_cgroup.cpu_stat(group)) if group else None
        rc = client.wait(timeout=60)
        if rc != 0 or k1 is None:
            raise RuntimeError(f"vllm bench serve (TP={self.tp}, arm {self.arm}, shape {shape.name}) failed "
                               f"(code {rc}): {''.join(lines)[-2000:]}")
        with open(os.path.join(out_dir, name)) as f:
            res = json.load(f)
        if res.get("failed"):
            raise RuntimeError(f"vllm bench serve (TP={self.tp}, arm {self.arm}, shape {shape.name}): "
                               f"{res['failed']} requests failed: {res.get('errors', [])[:3]}")
        pct = {k: 100.0 * (k1[k] - k0.get(k, 0.0)) / span for k in k1}
        return {"req_per_s": res["request_throughput"], "tok_per_s": res["output_throughput"],
                "ttft_p50_ms": res["median_ttft_ms"], "ttft_p99_ms": res["p99_ttft_ms"],
                "itl_p50_ms": res["median_itl_ms"], "itl_p99_ms": res["p99_itl_ms"],
                "host_cpu_pct": sum(v for k, v in pct.items() if k == "engine_core" or k.startswith("worker")),
                "front_end_pct": pct.get("front_end", 0.0), "cpu_pct": pct, "cgroup": throttled,
                "texts": res.get("generated_texts", [])}

    def processes(self) -> dict[int, str]:
        return tree(self.proc.pid)

    def close(self) -> None:
        """SIGINT (vLLM's graceful shutdown), then SIGKILL of whatever of the server's group is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def run_server(tp: int, arm: str, model: str, quick: bool, seed: int, sync: bool = False) -> dict:
    """One fresh server of `arm` through every shape; then its idle CPU."""
    server = Server(tp, arm, model, sync=sync)
    try:
        with tempfile.TemporaryDirectory(prefix="hotloop-vllm-online-") as out_dir:
            res = {shape.name: server.bench(shape, seed, out_dir) for shape in shapes(quick, "sim")}
        res["idle_pct"] = idle_cpu(server.proc.pid)[0]
        res["process_titles"] = sorted(set(server.processes().values()))
        if os.environ.get(cpu_cgroup.ENV):  # the pod regime: every process of the server in the cgroup
            inside = cpu_cgroup.members(os.environ[cpu_cgroup.ENV])
            outside = sorted(f"{c} {p}" for p, c in server.processes().items() if p not in inside)
            if outside:
                raise RuntimeError(f"TP={tp} arm {arm}: processes of vllm serve ran outside the CPU-limited cgroup: "
                                   f"{outside}")
    finally:
        server.close()
    return res


def run(quick: bool = False, rounds: int | None = None, tps=None, seed: int = 0,
        sync: bool = False) -> tuple[dict, Report]:
    """Every TP size and arm through vllm serve (see the module docstring); on vLLM's async scheduling path (its GPU
    default) or with `sync` its synchronous one."""
    from hotloop.vllm import check_version, tiny_model

    version = check_version()
    tps = tuple(tps or (1, 2, 4))
    arms = SIM_ARMS
    model = tiny_model.build(seed, heads=4 if 4 in tps else 2)
    rounds = rounds or (1 if quick else 3)
    progress = Progress("bench vllm (sim, online)", rounds * len(tps) * len(arms))
    raw = {(tp, arm): [] for tp in tps for arm in arms}
    reference, differ = {}, set()
    for rnd in range(rounds):
        order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
        for tp in tps:
            for arm in order:
                res = run_server(tp, arm, model, quick, seed, sync)
                compare_outputs(res, "texts", reference, differ, f"TP={tp} {arm} round {rnd + 1}")
                raw[(tp, arm)].append(res)
                progress.step(f"round {rnd + 1} TP={tp} {arm}: arrivals {res['arrivals']['req_per_s']:.0f} req/s, "
                              f"TTFT p99 {res['arrivals']['ttft_p99_ms']:.1f} ms, decode "
                              f"{res['decode']['tok_per_s']:.0f} tok/s, host CPU {res['decode']['host_cpu_pct']:.0f} %")
    progress.close()
    data = summarize(raw, tps, quick, rounds, arms)
    from hotloop.vllm.sim_device import requested

    data.update({"vllm_version": version, "seed": seed, "device": "sim", "online": True,
                 "sim_device_us": requested() or sim_spec(),
                 "identical_greedy_outputs": not differ and all(reference.values()),
                 "outputs_differ": sorted(differ), "path": "sync" if sync else "async"})
    data["goals"] = goals(data, tps)
    return data, render(data, tps)


def summarize(raw: dict, tps, quick: bool, rounds: int, arms) -> dict:
    data = {"rounds": rounds, "arms": list(arms), "shapes": [s.__dict__ for s in shapes(quick, "sim")], "tp": {}}
    for tp in tps:
        rec = data["tp"][tp] = {}
        for shape in shapes(quick, "sim"):
            per = rec[shape.name] = {}
            own = [r[shape.name] for r in raw[(tp, "vllm")]]
            for arm in arms:
                runs = [r[shape.name] for r in raw[(tp, arm)]]
                per[arm] = {k: over_rounds([r[k] for r in runs]) for k in FIGURES}
                per[arm]["cpu_pct"] = {k: median([r["cpu_pct"].get(k, 0.0) for r in runs])
                                       for k in sorted(set().union(*(r["cpu_pct"] for r in runs)))}
                if all(r.get("cgroup") for r in runs):  # the pod regime: the quota's throttling over the run
                    per[arm]["cgroup"] = {k: over_rounds([r["cgroup"][k] for r in runs])
                                          for k in ("throttled_periods", "throttled_s", "periods")}
                if arm != "vllm":
                    per[f"{arm}/vLLM"] = {k: over_rounds([h[k] / o[k] if o[k] else float("nan")
                                                          for h, o in zip(runs, own)]) for k in FIGURES}
        rec["idle"] = {arm: {k: over_rounds([r["idle_pct"][k] for r in raw[(tp, arm)]]) for k in IDLE_PARTS}
                       for arm in arms}
        spin = raw[(tp, "vllm+spinloop")]
        for arm in ("hotloop", "hotloop+loop"):
            runs = raw[(tp, arm)]
            rec["decode"][f"{arm}/spinloop"] = {"host_cpu_pct": over_rounds(
                [h["decode"]["host_cpu_pct"] / s["decode"]["host_cpu_pct"] for h, s in zip(runs, spin)])}
    return data


def goals(data: dict, tps) -> list[dict]:
    out = []
    for arm in ("hotloop", "hotloop+loop"):
        def r(tp, shape, key):
            return data["tp"][tp][shape][f"{arm}/vLLM"][key]["median"]

        thr = {f"TP={tp} {s}": r(tp, s, "req_per_s" if s == "arrivals" else "tok_per_s") for tp in tps
               for s in ("arrivals", "decode", "single")}
        out.append({"goal": f"online, {arm}: req/s (arrivals) and tok/s (decode, single) >= 1.0x vLLM's",
                    "met": all(v >= 1.0 for v in thr.values()),
                    "detail": ", ".join(f"{k} {v:.2f}" for k, v in thr.items())})
        lat = {f"TP={tp} {s} {k.split('_ms')[0]}": r(tp, s, k) for tp in tps
               for s, k in (("arrivals", "ttft_p99_ms"), ("poisson", "ttft_p99_ms"), ("poisson", "itl_p99_ms"))}
        out.append({"goal": f"online, {arm}: TTFT p99 (arrivals, Poisson) and ITL p99 (Poisson) <= 0.9x vLLM's",
                    "met": all(v <= 0.9 for v in lat.values()),
                    "detail": ", ".join(f"{k} {v:.2f}" for k, v in lat.items())})
        cpu = {tp: (r(tp, "decode", "host_cpu_pct"),
                    data["tp"][tp]["decode"][f"{arm}/spinloop"]["host_cpu_pct"]["median"]) for tp in tps}
        out.append({"goal": f"online, {arm}: host CPU of the engine core and workers while decoding <= 0.25x vLLM's "
                            "and <= 0.5x vLLM's with its spinloop extension",
                    "met": all(a <= 0.25 and b <= 0.5 for a, b in cpu.values()),
                    "detail": ", ".join(f"TP={tp} {a:.2f} / {b:.2f}" for tp, (a, b) in cpu.items())})
    out.append(identical_goal(data, "online: generated texts"))
    return out


def render(data: dict, tps) -> Report:
    parts, n, arms = [], data["rounds"], data["arms"]
    base, per_token = data["sim_device_us"]
    keys_of = {"arrivals": ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "host_cpu_pct", "front_end_pct"),
               "poisson": ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "host_cpu_pct", "front_end_pct"),
               "decode": ("tok_per_s", "itl_p50_ms", "itl_p99_ms", "host_cpu_pct", "front_end_pct"),
               "single": ("tok_per_s", "itl_p50_ms", "itl_p99_ms", "host_cpu_pct", "front_end_pct")}
    for shape in data["shapes"]:
        keys = keys_of[shape["name"]]
        rows = []
        for tp in tps:
            per = data["tp"][tp][shape["name"]]
            rows += [[f"TP={tp} {arm}"] + [median_range(per[arm][k], FIGURES[k][1]) for k in keys] for arm in arms]
            rows += [[f"TP={tp} {arm}/vLLM"] + [median_range(per[f"{arm}/vLLM"][k], 2) for k in keys]
                     for arm in arms[1:]]
        how = "all at once" if shape["rate"] <= 0 else f"Poisson {shape['rate']:g} req/s"
        path = "synchronous path" if data.get("path") == "sync" else "async scheduling"
        parts.append(table(
            f"vllm serve + vllm bench serve (vLLM {data['vllm_version']}) on the simulated device ({base:g} us + "
            f"{per_token:g} us a token, vLLM's {path}), shape '{shape['name']}': {shape['n']} requests of "
            f"{shape['prompt_tokens']} / {shape['output_tokens']} tokens, {how}; median (min-max) over {n} "
            f"round{'s' * (n > 1)}",
            ["TP / arm"] + [FIGURES[k][0] for k in keys], rows, key=f"online-{shape['name']}"))
    rows = cpu_rows(data, tps, lambda tp, arm, pct: [
        median_range(data["tp"][tp]["decode"][arm]["host_cpu_pct"], 0),
        fmt(data["tp"][tp]["idle"][arm]["waiters"]["median"], 3)])
    parts.append(table("Host CPU of the server's processes while decoding (percent of one core, median over rounds), "
                       "and idle after the last shape", ["TP / arm", "front end", "engine core", "each worker",
                                                         "engine core + workers", "idle: waiting threads %"],
                       rows, key="online-cpu"))
    parts.append(goal_lines(data["goals"]))
    parts.append(__doc__.split("\n\n", 1)[1].strip().replace("\n", " "))
    return Report(parts)


__all__ = ["Server", "run", "run_server"]
