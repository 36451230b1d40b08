"""bench/vllm/regimes.py without an engine: the names ``--regime`` takes, each regime's settings applied around a
block and put back after (the pod regime's cgroup removed, also on an exception), the regime goals read from a
record."""

import os

import pytest

from hotloop.bench.vllm import regimes
from hotloop.testing.cpu_cgroup import ENV, CpuCgroup, contained


def test_regime_names_expand_and_unknown_ones_are_refused():
    assert regimes.names(None) == ("device-bound", "pod-1.5", "pod-1.0", "host-bound")
    assert regimes.names("pod,host-bound,pod-1.0") == ("pod-1.5", "pod-1.0", "host-bound")
    with pytest.raises(ValueError, match="unknown regime 'gpu'.*device-bound"):
        regimes.names("gpu")


def test_device_bound_sets_the_device_time_and_puts_the_environment_back(monkeypatch):
    monkeypatch.setenv("HOTLOOP_VLLM_SIM_DEVICE", "900+1")
    monkeypatch.delenv(ENV, raising=False)
    with regimes.applied("device-bound") as group:
        assert group is None and os.environ["HOTLOOP_VLLM_SIM_DEVICE"] == "6500+2"
        assert contained(["true"]) == ["true"]  # no cgroup: started as it is
    assert os.environ["HOTLOOP_VLLM_SIM_DEVICE"] == "900+1" and ENV not in os.environ


def test_the_pod_regime_starts_processes_in_its_cgroup_and_removes_it_on_failure(monkeypatch):
    why = CpuCgroup.unavailable()
    if why:
        pytest.skip(why)
    import subprocess

    monkeypatch.delenv("HOTLOOP_VLLM_SIM_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="bench failed"):
        with regimes.applied("pod-1.5") as group:
            assert os.environ[ENV] == group.path and os.environ["HOTLOOP_VLLM_SIM_DEVICE"] == "1300+2"
            out = subprocess.run(contained(["sh", "-c", "cat /proc/self/cgroup"]), capture_output=True, text=True)
            assert os.path.basename(group.path) in out.stdout, out.stdout
            raise RuntimeError("bench failed")
    assert not os.path.exists(group.path)
    assert ENV not in os.environ and "HOTLOOP_VLLM_SIM_DEVICE" not in os.environ


def _record(ratios: dict, throttled: dict | None = None) -> dict:
    """A one-TP record whose hotloop/vLLM ratios are `ratios` (figure -> ratio, every shape)."""
    per_shape = {}
    for shape in ("arrivals", "poisson", "decode", "single"):
        per_shape[shape] = {"hotloop/vLLM": {k: {"median": v} for k, v in ratios.items()},
                            "hotloop": {}, "vllm": {}}
        if throttled:
            per_shape[shape]["hotloop"]["cgroup"] = {"throttled_s": {"median": throttled["hotloop"]}}
            per_shape[shape]["vllm"]["cgroup"] = {"throttled_s": {"median": throttled["vllm"]}}
    return {"arms": ["vllm", "hotloop"], "tp": {1: per_shape}}


def test_regime_goals_read_the_default_arm():
    level = {"req_per_s": 1.0, "tok_per_s": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "itl_p50_ms": 1.0,
             "itl_p99_ms": 1.0, "host_cpu_pct": 0.4}
    host = regimes.regime_goals("host-bound", _record(level))
    assert [g["met"] for g in host] == [True, True]
    device = regimes.regime_goals("device-bound", _record(level))
    assert [g["met"] for g in device] == [True, True, False, True]  # p99 must be <= 0.9x there
    better = dict(level, tok_per_s=1.3, ttft_p99_ms=0.4, itl_p99_ms=0.5)
    pod = regimes.regime_goals("pod-1.0", _record(better, {"hotloop": 0.1, "vllm": 1.0}))
    assert [g["met"] for g in pod] == [True, True, True]
    pod = regimes.regime_goals("pod-1.0", _record(better, {"hotloop": 0.5, "vllm": 1.0}))
    assert [g["met"] for g in pod] == [True, True, False] and "0.50" in pod[2]["detail"]
