"""NVTX from Python: hotloop.nvtx.Range and the core's wait ranges show up under an injection library
(HOTLOOP_NVTX_RECORDER: tests/nvtx/nvtx_recorder.cpp as built by the C++ suite; scripts/test.sh sets it), and
nothing breaks without one."""

import os
import subprocess
import sys

import pytest

import hotloop
import hotloop.nvtx

PROBE = """
import hotloop, hotloop.nvtx
STEP = hotloop.nvtx.Range("engine.step")
with STEP:
    hotloop.wait_any([hotloop.Flag()], timeout=0.002, policy=hotloop.WaitPolicy(spin_us=1, yield_us=0))
with STEP:
    pass
print("ok")
"""


def test_ranges_work_without_a_tool():
    r = hotloop.nvtx.Range("engine.step")
    assert r.name == "engine.step"
    with r:
        with r:
            pass
    with pytest.raises(ValueError):
        with r:
            raise ValueError("exceptions pass through")


def test_ranges_appear_under_an_injection_library(tmp_path):
    recorder = os.environ.get("HOTLOOP_NVTX_RECORDER")
    if not recorder or not os.path.exists(recorder):
        pytest.skip("HOTLOOP_NVTX_RECORDER does not name the recorder built by the C++ suite (scripts/test.sh sets it)")
    if not hotloop.nvtx.compiled_in():
        pytest.skip("hotloop was built without the NVTX3 headers")
    record = tmp_path / "record.txt"
    env = dict(os.environ, NVTX_INJECTION64_PATH=recorder, HOTLOOP_NVTX_RECORD=str(record))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    lines = record.read_text().splitlines()
    assert lines[:3] == ["push hotloop:engine.step", "push hotloop:hotloop.wait", "push hotloop:hotloop.wait.spin"]
    assert "push hotloop:hotloop.wait.park" in lines
    assert lines.count("push hotloop:engine.step") == 2
    assert sum(l.startswith("push") for l in lines) == sum(l.startswith("pop") for l in lines)
