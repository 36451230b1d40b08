"""The ``hotloop`` command: ``hotloop bench [NAME ...] [--full] [--json PATH] [--report DIR]``, ``hotloop info`` and ``hotloop soak``.

``hotloop bench`` alone runs the short version of every benchmark (a few minutes); ``--full`` the long runs. It
ends by printing the verdict on every goal the benchmarks state, then writes the report page (the verdict, every
table and plot; bench/report_page.py) and names it."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cuda_driver() -> str:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return "libcuda.so.1 loads"
    except OSError as e:
        return f"not available ({e})"


# The benchmarks that run hotloop's engine (PyTorch, which a plain install leaves out: pyproject's extra "engine")
NEEDS_TORCH = ("engine", "orchestrator")
NO_TORCH = "PyTorch is not installed (pip install torch==2.13.0, the CPU build, or \"hotloop[engine]\")"


def _torch_version() -> str | None:
    """torch's version, without importing it (seconds); None where it cannot be imported."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "installed (no package metadata)"


def info() -> dict:
    import hotloop
    from hotloop import _core

    build = _core.build_info()
    park = _core.park_backend()
    return {
        "hotloop": hotloop.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "build_type": build["build_type"],
        "compiler": build["compiler"],
        "futex_waitv": build["futex_waitv"],
        # how a wait over doorbells and descriptors together sleeps; the reason when it is not io_uring
        "park_backend": park["backend"] + (f" ({park['reason']})" if park["reason"] else ""),
        "cuda_driver": _cuda_driver(),
        "torch": _torch_version() or f"not installed: the engine, the orchestrator and soak need it ({NO_TORCH})",
        "nvtx": "ranges built in (domain 'hotloop')" if build["nvtx"] else "built without the NVTX3 headers",
        "default_wait_policy": repr(hotloop.WaitPolicy()),
    }


def cmd_info(args) -> int:
    for k, v in info().items():
        print(f"{k:20s} {v}")
    return 0


def cmd_bench(args) -> int:
    from hotloop.bench import BENCHMARKS
    from hotloop.bench.vllm import offline, omni, ray_executor, regimes

    # vllm, vllm-omni and vllm-ray only when named: they need vLLM (and vllm-omni) and take minutes
    benchmarks = {**BENCHMARKS, "vllm": offline.run, "vllm-omni": omni.run, "vllm-ray": ray_executor.run}
    names = _bench_names(args, list(BENCHMARKS), benchmarks)
    if names is None:
        return 2
    if args.regime and args.device != "sim":
        print("hotloop bench vllm: --regime picks the simulated device's host regime: add --device sim",
              file=sys.stderr)
        return 2
    regime_names = regimes.names(args.regime) if args.device == "sim" else ()
    quick = not args.full
    record = {"info": info(), "quick": quick, "results": {}}
    report = os.path.abspath(args.report) if args.report else None
    if report:
        os.makedirs(report, exist_ok=True)
    engine_plot = args.plot or (os.path.join(report, "engine-latency.png") if report else None)
    plots = {"engine": [engine_plot]} if engine_plot else {}
    vllm_plot = os.path.join(report, "vllm.png") if report else None  # the regimes' plots are named after it
    if report:
        plots["vllm"] = [regimes.plot_path_of(vllm_plot, n) for n in regime_names] if regime_names else [vllm_plot]
    texts = {}
    for name in names:
        fn, kwargs = _bench_call(name, benchmarks[name], args, engine_plot, vllm_plot, regime_names)
        data, text = fn(quick=quick, **kwargs)
        record["results"][name] = data
        texts[name] = text
        print(f"== hotloop bench {name}{' (short run; --full for the long one)' if quick else ''} ==\n{text}\n",
              flush=True)
    _bench_outputs(record, texts, args.json, report, plots)
    return 0


def _bench_names(args, default: list[str], benchmarks: dict) -> list[str] | None:
    """The benchmarks to run: the named ones (None, said why, when one is unknown or needs the missing PyTorch),
    else every default one that can run here."""
    names = args.names or default
    if _torch_version() is None:
        named = [n for n in args.names if n in NEEDS_TORCH]
        if named:
            print(f"hotloop bench {' '.join(named)}: runs the engine, which needs PyTorch; {NO_TORCH}", file=sys.stderr)
            return None
        if not args.names:
            print(f"hotloop bench: skipping {', '.join(NEEDS_TORCH)}: {NO_TORCH}", file=sys.stderr)
            names = [n for n in names if n not in NEEDS_TORCH]
    unknown = [n for n in names if n not in benchmarks]
    if unknown:
        print(f"hotloop bench: unknown benchmark(s) {unknown}; choose from {sorted(benchmarks)}", file=sys.stderr)
        return None
    return names


def _bench_call(name: str, fn, args, engine_plot, vllm_plot, regime_names) -> tuple:
    """The function that runs benchmark `name` and its keyword arguments from the command line."""
    from hotloop.bench.vllm import regimes

    if name == "engine":
        return fn, {"plot_path": engine_plot}
    if name == "vllm-omni":
        return fn, {"rounds": args.rounds}
    if name != "vllm":
        return fn, {}
    kwargs = {"rounds": args.rounds, "plot_path": vllm_plot,
              "online": args.online, "sync": args.sync,
              "tps": tuple(int(t) for t in args.tp_sizes.split(",")) if args.tp_sizes else None}
    if regime_names:  # the simulated device: a run per host regime (bench/vllm/regimes.py)
        return functools.partial(regimes.run, regime_names), kwargs
    return fn, {**kwargs, "device": args.device}


def _bench_outputs(record: dict, texts: dict, json_path, report, plots: dict) -> None:
    """The goals' verdicts; the JSON record and the report page where asked for."""
    from hotloop.bench import report_page
    from hotloop.bench.report import verdict_line

    quick = record["quick"]
    lines = [verdict_line(b, g) for b, goals in report_page.verdicts(record).items() for g in goals]
    if lines:
        met = sum(line.startswith("met ") for line in lines)
        print(f"== goals: {met} of {len(lines)} met{' (short run)' if quick else ''} ==\n" + "\n".join(lines) + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(record, f, indent=2, default=float)
        print(f"wrote {json_path}")
    if report:
        page, images = report_page.write(record, texts, report, plots)
        print(f"report: {page} ({len(images)} plots in {report})")


def cmd_soak(args) -> int:
    if _torch_version() is None:
        print(f"hotloop soak: runs an engine and an orchestrator, which need PyTorch; {NO_TORCH}", file=sys.stderr)
        return 2
    if args.network:
        from hotloop.testing.netns import Nodes

        why = Nodes.unavailable()
        if why:
            print(f"hotloop soak --network: {why}", file=sys.stderr)
            return 2
    if args.network_interval_s <= 0:
        print(f"hotloop soak: --network-interval-s must be > 0, got {args.network_interval_s:g}", file=sys.stderr)
        return 2
    if args.sustained_loss and not args.network:
        print("hotloop soak: --sustained-loss needs --network (the loss is on the simulated nodes' links)",
              file=sys.stderr)
        return 2
    if args.no_delay_proxy and not args.network:
        print("hotloop soak: --no-delay-proxy needs --network", file=sys.stderr)
        return 2
    if not 0 <= args.sustained_loss < 100:
        print(f"hotloop soak: --sustained-loss is a % in [0, 100), got {args.sustained_loss}", file=sys.stderr)
        return 2
    from hotloop.soak import run

    return run(args.minutes, args.seed, args.json, args.goal_s, not args.no_fail_on_goal, args.network,
               args.network_interval_s, args.sustained_loss, not args.no_delay_proxy)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hotloop", description="hotloop: the hot loop of LLM serving, made cheap.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="run benchmarks (each next to the baseline it replaces)")
    b.add_argument("names", nargs="*", help="which benchmarks (default: all but vllm and vllm-omni): wait, queue, "
                   "notifier, engine, orchestrator, vllm (vLLM's engine on its own queue and on hotloop's; needs "
                   "hotloop[vllm]), vllm-omni (vllm-omni's two-stage text pipeline with and without hotloop; needs "
                   "scripts/install_vllm_omni.sh), vllm-ray (vLLM's Ray executor on two simulated nodes: outputs, a "
                   "cut node, a stranger, the broadcast's cost; needs root and hotloop[vllm,ray])")
    b.add_argument("--full", action="store_true", help="long runs with more repeats (default: short runs)")
    b.add_argument("--report", metavar="DIR", default="hotloop-bench-report",
                   help="where the report page (index.html) and its plots go (default: %(default)s; '' for none)")
    b.add_argument("--plot", metavar="PATH", default=None,
                   help="where the engine benchmark writes its latency plot (default: inside the report directory)")
    b.add_argument("--rounds", type=int, default=None,
                   help="rounds of the vllm and vllm-omni benchmarks, arms alternating (default 1; --full: 3 for "
                   "vllm, 4 for vllm-omni)")
    b.add_argument("--device", choices=("cpu", "sim"), default="cpu",
                   help="vllm: cpu (vLLM's CPU build computes the model; default) or sim (a simulated device: vLLM's "
                   "host work is real, each forward a modelled device time off the CPU, as on a GPU host; arms "
                   "include vLLM's spinloop extension; TP 1, 2 and 4)")
    b.add_argument("--online", action="store_true", help="vllm --device sim: the shapes through vLLM's own server "
                   "and client (vllm serve loaded by vllm bench serve)")
    b.add_argument("--sync", action="store_true", help="vllm --device sim: vLLM's synchronous path (async scheduling "
                   "off); by default the simulated device runs vLLM's GPU default, async scheduling")
    b.add_argument("--regime", default=None,
                   help="vllm --device sim: the host regimes, comma-separated: device-bound (the device's step 6.5 "
                   "ms), pod-1.5 and pod-1.0 ('pod': the engine's processes in a cgroup with that CPU quota; needs "
                   "root and a cpu controller), host-bound (1.3 ms on these cores); default all")
    b.add_argument("--tp-sizes", default=None, help="vllm: tensor parallel sizes, e.g. 1,2 (default 1,2; sim: 1,2,4)")
    b.add_argument("--json", metavar="PATH", help="also write the figures and the machine facts as JSON")
    b.set_defaults(fn=cmd_bench)
    i = sub.add_parser("info", help="print what a bug report needs")
    i.set_defaults(fn=cmd_info)
    s = sub.add_parser("soak", help="chaos soak: the whole stack under load while processes are killed")
    s.add_argument("--minutes", type=float, default=5.0, help="how long the chaos runs (fractions allowed)")
    s.add_argument("--seed", type=int, default=0, help="seeds the chaos schedule and the load")
    s.add_argument("--json", metavar="PATH", help="also write the record as JSON")
    s.add_argument("--goal-s", type=float, default=1.0, help="kill-to-error goal in seconds (max; default 1)")
    s.add_argument("--no-fail-on-goal", action="store_true", help="report the kill-to-error goal, do not fail on it")
    s.add_argument("--network", action="store_true",
                   help="run the queues' writers and remote readers on simulated nodes (network namespaces; needs "
                   "root, iproute2 and nftables) and inject network faults on the readers' nodes: partitions "
                   "longer than the peer timeout, short cuts, 2 %% loss, 20 ms +- 5 ms delay")
    s.add_argument("--network-interval-s", type=float, default=8.0,
                   help="mean seconds between network faults (default 8; the first faults cover every kind)")
    s.add_argument("--sustained-loss", type=int, default=0, metavar="PCT",
                   help="with --network: every remote reader node drops PCT %% of its packets each way for the whole "
                   "run, under the other faults (default 0: off; 2 is the lossy link the keepalive is built for)")
    s.add_argument("--no-delay-proxy", action="store_true",
                   help="with --network: every remote reader connects straight to its writer (by default the last "
                   "remote rank of each group reads through a user-space delay proxy, which the delay faults "
                   "switch on); no delay faults are injected")
    s.set_defaults(fn=cmd_soak)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
