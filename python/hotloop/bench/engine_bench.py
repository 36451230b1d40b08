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

Ray rows (when Ray is installed and a loopback-only network namespace can be made): tp=2 on a simulated two-node
Ray cluster, both ranks on one node and rank 1 on the second node, next to multiproc tp=2; ``engine_ray.py`` runs
them in the cluster's own process, started here by its module name. Both run the workloads of
``engine_workloads.py``.

Method notes: TTFT is measured at the client (send -> first token received); CPU from /proc (utime + stime).

Device: the engines run the model on ``device`` (``run(device=...)``; the CLI takes ``$HOTLOOP_BENCH_DEVICE``,
default "cpu"; ``benchmarks/gpu_check.sh`` runs it with "cuda"). On CUDA the in-process executor launches each step
from the engine thread and its completion comes from hotloop.cuda.StepNotifier (the engine loop waits on it in
hotloop mode); the multi-process executor's rank 0 waits on its own notifier before answering.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys

from hotloop.bench.engine_workloads import MODEL, one_engine
from hotloop.bench.report import NO_PLOT, Progress, Report, cdf_panel, fmt, median_spread, pyplot, table

MODES = ("block", "poll", "hotloop")
EXECUTORS = ("inprocess", "multiproc")


def _ray_unavailable(device: str) -> str | None:
    """Why the Ray rows cannot run here (None when they can)."""
    from hotloop.testing import netns

    if device != "cpu":
        return "the simulated cluster runs the CPU model only"
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'hotloop[ray]')"
    return netns.unavailable()


def _ray_results(p: dict) -> dict:
    """Run the Ray rows in their cluster's process (engine_ray.py, in a loopback-only network namespace);
    {(label, "hotloop"): (runs, idle)} as the other rows are kept."""
    from hotloop.testing import netns

    child = netns.start([sys.executable, "-m", "hotloop.bench.engine_ray", json.dumps(p)], stdout=subprocess.PIPE,
                        text=True)
    out, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"the Ray rows' cluster process failed (exit code {child.returncode}); see its output "
                           "above")
    got = json.loads(out.strip().splitlines()[-1])
    return {(label, "hotloop"): (runs, idle) for label, (runs, idle) in got.items()}


def _med(runs, part, key):
    return median_spread([r[part][key] for r in runs])


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
            results[(executor, mode)] = asyncio.run(one_engine(executor, mode, p, progress, device))
    progress.close()
    ray_missing = _ray_unavailable(device)
    if ray_missing is None:
        results.update(_ray_results(p))

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
