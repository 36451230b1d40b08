"""The host regimes of ``hotloop bench vllm --device sim``: vLLM's engine in every arm under each kind of GPU host its
users run, each regime a run of ``offline`` (or ``online``) under its own settings, with a table set and goals each.

- ``device-bound``: the simulated device's step is 6500 us + 2 us a token, so the host work of a step on vLLM's
  queue (1.46 ms at batch 1, 1.58 ms at 16, measured on this 2-vCPU VM at 1300+2: the last round's closing note)
  is at most a quarter of it, as on a GPU host where the model is large. What it models: the device's share of a
  step. What it does not: a GPU node's spare cores. On two cores vLLM's spinners still fill every idle moment of
  the step; a core per process is modelled by the pinned cadence bench (``hotloop bench queue``) and read per
  process (the CPU tables), figures of another kind kept apart.
- ``pod-1.5`` and ``pod-1.0`` (``pod``: both): 1300+2, every process of the engine (offline: the driver, which is
  the front end and its load, the engine core, the workers; ``--online``: ``vllm serve``'s processes, vLLM's client
  outside) born in a cgroup with a CFS quota of 1.5 / 1.0 cores (``hotloop.testing.cpu_cgroup``: cgroup v2
  ``cpu.max`` or v1 ``cpu.cfs_quota_us``), as a Kubernetes ``resources.limits.cpu`` makes one. Per shape the
  quota's throttled periods and throttled seconds (``cpu.stat``) beside the latency figures. The cgroup is removed
  after the regime, also when it fails; where no cpu controller is writable the regime is skipped with the reason.
- ``host-bound``: 1300+2 on this host's cores (the regime measured before: a step's host work outlasts its device
  time).

``applied(name)`` sets a regime up around a block (the device's step time in ``HOTLOOP_VLLM_SIM_DEVICE``, the
cgroup in ``HOTLOOP_CPU_CGROUP``, which the drivers' launchers read); ``run(names, ...)`` runs them in turn.
Goals per regime (the issue's; the default arm, ``hotloop``, against vLLM's queue, medians of within-round
ratios): ``regime_goals``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from hotloop.bench.report import Report, fmt, goal_lines, median_range, table
from hotloop.testing.cpu_cgroup import ENV as CGROUP_ENV
from hotloop.testing.cpu_cgroup import CpuCgroup


@dataclasses.dataclass(frozen=True)
class Regime:
    name: str
    sim_device: str  # HOTLOOP_VLLM_SIM_DEVICE: base us + us a token
    quota: float | None  # the CPU quota of the engine's processes, in cores (None: none)
    what: str


REGIMES = {r.name: r for r in (
    Regime("device-bound", "6500+2", None, "the device's step 6.5 ms, the host work at most a quarter of it"),
    Regime("pod-1.5", "1300+2", 1.5, "the engine's processes in a cgroup with a 1.5-core CPU quota"),
    Regime("pod-1.0", "1300+2", 1.0, "the engine's processes in a cgroup with a 1-core CPU quota"),
    Regime("host-bound", "1300+2", None, "a step's host work outlasts its 1.3 ms device time on these cores"),
)}
GROUPS = {"pod": ("pod-1.5", "pod-1.0"), "all": tuple(REGIMES)}


def names(spec: str | None) -> tuple[str, ...]:
    """The regimes a ``--regime`` value names (comma-separated; ``pod`` and ``all`` expand; default all)."""
    out: list[str] = []
    for part in (spec or "all").split(","):
        part = part.strip()
        if part not in REGIMES and part not in GROUPS:
            raise ValueError(f"unknown regime {part!r}: choose from {', '.join(list(REGIMES) + list(GROUPS))}")
        out += [n for n in GROUPS.get(part, (part,)) if n not in out]
    return tuple(out)


@contextlib.contextmanager
def applied(name: str):
    """Regime `name`'s settings around the block (yields its CpuCgroup, or None); the environment is put back and
    the cgroup removed after, also on an exception."""
    regime = REGIMES[name]
    saved = {k: os.environ.get(k) for k in ("HOTLOOP_VLLM_SIM_DEVICE", CGROUP_ENV)}
    os.environ["HOTLOOP_VLLM_SIM_DEVICE"] = regime.sim_device
    group = None
    try:
        if regime.quota is not None:
            group = CpuCgroup(regime.quota)
            os.environ[CGROUP_ENV] = group.path
        yield group
    finally:
        if group is not None:
            group.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(regimes, quick: bool = False, rounds: int | None = None, tps=None, seed: int = 0,
        plot_path: str | None = "hotloop-bench-vllm.png", online: bool = False, arms=None, sync: bool = False):
    """Every regime in `regimes` in turn, each a whole run of the offline bench (or ``online``) under its settings.
    Returns ({"regimes": {name: that run's record}, "goals": every regime's goals, each named by its regime},
    the text: a heading, the run's tables and the regime's goals, per regime)."""
    from hotloop.bench.vllm import offline

    out: dict = {"regimes": {}, "goals": [], "skipped_regimes": {}}
    text = Report()
    for name in regimes:
        regime = REGIMES[name]
        if regime.quota is not None and CpuCgroup.unavailable():
            why = CpuCgroup.unavailable()
            out["skipped_regimes"][name] = why
            text.append(f"Regime {name}: skipped ({why})")
            continue
        path = None if plot_path is None else plot_path_of(plot_path, name)
        with applied(name):
            data, rep = offline.run(quick=quick, rounds=rounds, tps=tps, seed=seed, plot_path=path, device="sim",
                                    online=online, arms=arms, sync=sync)
        if "skipped" in data:
            return data, rep
        data["regime"] = dataclasses.asdict(regime)
        own = regime_goals(name, data)
        for g in data["goals"] + own:
            g["goal"] = f"{name}: {g['goal']}"
        out["goals"] += data["goals"] + own
        out["regimes"][name] = data
        tp_list = sorted(data["tp"])
        text.append(f"Regime {name} (HOTLOOP_VLLM_SIM_DEVICE={regime.sim_device}"
                    + (f", CPU quota {regime.quota:g} cores" if regime.quota else "") + f"): {regime.what}")
        text.extend(rep if isinstance(rep, list) else [rep])
        if regime.quota is not None:
            text.append(throttle_table(name, data, tp_list))
        text.append(goal_lines(own))
    return out, text


def plot_path_of(path: str, name: str) -> str:
    """Where regime `name`'s plot goes, given the bench's plot path."""
    root, ext = os.path.splitext(path)
    return f"{root}-{name}{ext or '.png'}"


def throttle_table(name: str, data: dict, tps):
    """Per TP, arm and shape: the quota's throttled periods and seconds over the shape's run."""
    rows = []
    for tp in tps:
        for arm in data["arms"]:
            cells = []
            for shape in data["shapes"]:
                cg = data["tp"][tp][shape["name"]][arm].get("cgroup")
                cells.append("-" if cg is None else f"{median_range(cg['throttled_periods'], 0)} / "
                             f"{median_range(cg['throttled_s'], 2)} s")
            rows.append([f"TP={tp} {arm}"] + cells)
    return table(f"Regime {name}: the CPU quota's throttling per shape, throttled periods / throttled time (cpu.stat; "
                 "median (min-max) over rounds)", ["TP / arm"] + [s["name"] for s in data["shapes"]], rows,
                 key=f"throttled-{name}")


def _ratio(data: dict, tp: int, shape: str, key: str, arm: str = "hotloop") -> float:
    return data["tp"][tp][shape][f"{arm}/vLLM"][key]["median"]


def regime_goals(name: str, data: dict, arm: str = "hotloop") -> list[dict]:
    """The issue's goals for `name`, read on the default arm (hotloop's queue, the rule's wait, vLLM's loop)."""
    if arm not in data["arms"]:
        return []
    tps = sorted(data["tp"])
    thr = {f"TP={tp} {s}": _ratio(data, tp, s, "req_per_s" if s == "arrivals" else "tok_per_s", arm)
           for tp in tps for s in ("arrivals", "decode", "single")}

    def lat(keys):
        return {f"TP={tp} {s} {k.split('_ms')[0]}": _ratio(data, tp, s, k, arm) for tp in tps
                for s in ("arrivals", "poisson") for k in keys}

    def goal(text, values, ok):
        return {"goal": f"{arm}: {text}", "met": all(ok(v) for v in values.values()),
                "detail": ", ".join(f"{k} {fmt(v, 2)}" for k, v in values.items())}

    if name == "device-bound":
        whole = {f"TP={tp}": _ratio(data, tp, "decode", "host_cpu_pct", arm) for tp in tps}
        waiting = {f"TP={tp}": data["tp"][tp]["decode"][f"{arm}/vLLM"]["wait_cpu"]["median"] for tp in tps
                   if "wait_cpu" in data["tp"][tp]["decode"].get(f"{arm}/vLLM", {})}
        return [goal("tok/s and req/s >= 1.0x vLLM's", thr, lambda v: v >= 1.0),
                goal("TTFT and ITL p50 <= 1.0x vLLM's", lat(("ttft_p50_ms", "itl_p50_ms")), lambda v: v <= 1.0),
                goal("TTFT and ITL p99 <= 0.9x vLLM's", lat(("ttft_p99_ms", "itl_p99_ms")), lambda v: v <= 0.9),
                goal("engine core + workers' whole CPU while decoding <= 0.5x vLLM's", whole, lambda v: v <= 0.5)] + (
                    [goal("waiting CPU of the queue reads while decoding (exact) <= 0.1x vLLM's", waiting,
                          lambda v: v <= 0.1)] if waiting else [])
    if name.startswith("pod"):
        tok = {k: v for k, v in thr.items() if "arrivals" not in k}
        throttled = {}
        for tp in tps:
            for s in ("arrivals", "poisson", "decode"):
                mine = data["tp"][tp][s][arm].get("cgroup")
                theirs = data["tp"][tp][s]["vllm"].get("cgroup")
                if mine and theirs:
                    a, b = mine["throttled_s"]["median"], theirs["throttled_s"]["median"]
                    throttled[f"TP={tp} {s}"] = a / b if b else (0.0 if a == 0 else float("inf"))
        return [goal("tok/s >= 1.2x vLLM's", tok, lambda v: v >= 1.2),
                goal("TTFT and ITL p99 <= 0.5x vLLM's", lat(("ttft_p99_ms", "itl_p99_ms")), lambda v: v <= 0.5),
                goal("throttled time <= 0.3x vLLM's (ratio of medians)", throttled, lambda v: v <= 0.3)]
    return [goal("tok/s and req/s >= 1.0x vLLM's", thr, lambda v: v >= 1.0),
            goal("TTFT and ITL p50 and p99 <= 1.0x vLLM's",
                 lat(("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")), lambda v: v <= 1.0)]


def main(argv=None) -> int:
    import argparse

    from hotloop.bench.report import print_result

    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.regimes", description="hotloop bench vllm "
                                 "--device sim, one run per host regime")
    ap.add_argument("--regime", default=None, help="comma-separated, from " + ", ".join(list(REGIMES) + list(GROUPS))
                    + " (default all)")
    ap.add_argument("--quick", action="store_true", help="1 round of the short shapes")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--tp-sizes", default=None, help="default 1,2,4")
    ap.add_argument("--arms", default=None, help="comma-separated, vllm first")
    ap.add_argument("--online", action="store_true", help="through vllm serve and vllm bench serve")
    ap.add_argument("--sync", action="store_true", help="vLLM's synchronous path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH", default="hotloop-bench-vllm.png")
    args = ap.parse_args(argv)
    try:
        chosen = names(args.regime)
    except ValueError as e:
        ap.error(str(e))
    data, text = run(chosen, quick=args.quick, rounds=args.rounds,
                     tps=tuple(int(t) for t in args.tp_sizes.split(",")) if args.tp_sizes else None, seed=args.seed,
                     plot_path=args.plot, online=args.online, arms=args.arms.split(",") if args.arms else None,
                     sync=args.sync)
    return print_result("vllm", data, text, args.json)


if __name__ == "__main__":
    import sys

    sys.exit(main())
