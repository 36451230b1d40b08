"""Model checks of the wake-up protocols: tests/model/*.pml verified exhaustively with the Spin model checker.

doorbell.pml models Doorbell (announce / sequence / re-check / futex park; ring and ring_if_parked; the eventfd
watchers) as wait_any() uses it; shm_ring.pml models ShmRing's publish / release handshake (a header word per
record) and its two doorbells. For each, the correct model must verify with no error over its whole state space
(not cut short by the depth bound), the statements where a sleeper is woken must be reachable (the model is not
vacuous), and every mutant (a macro that breaks one step of the protocol) must make the verification fail. See
tests/model/README.md. Spin is required: without it these tests fail, they do not skip (apt-get install spin).
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

MODEL_DIR = Path(__file__).parent / "model"
DEPTH_LIMIT = 10_000  # pan -m: far above the deepest run of either model (a few hundred steps)


def _tool(name, hint):
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"the model checks need `{name}` on PATH: {hint}")
    return path


def verify(tmp_path, model, define=None, optimize="-O2"):
    """Generates, compiles and runs the safety verifier of `model`; returns pan's output."""
    spin = _tool("spin", "install the Spin model checker (apt-get install spin)")
    cc = _tool("gcc", "install a C compiler (apt-get install gcc)")
    work = tmp_path / (define or "model")
    work.mkdir()
    shutil.copy(MODEL_DIR / model, work / model)
    args = [spin] + ([f"-D{define}"] if define else []) + ["-a", model]
    gen = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0 and (work / "pan.c").exists(), f"spin -a failed:\n{gen.stdout}{gen.stderr}"
    build = subprocess.run([cc, "-w", optimize, "-DSAFETY", "-o", "pan", "pan.c"], cwd=work, capture_output=True,
                           text=True, timeout=120)
    assert build.returncode == 0, f"compiling pan.c failed:\n{build.stderr[-4000:]}"
    run = subprocess.run(["./pan", f"-m{DEPTH_LIMIT}", "-w23"], cwd=work, capture_output=True, text=True,
                         timeout=120)
    return run.stdout + run.stderr


def errors(out):
    m = re.search(r"errors: (\d+)", out)
    assert m, f"no error count in pan's output:\n{out}"
    return int(m.group(1))


def unreached_lines(out, model):
    """The model's line numbers that pan lists as unreached in some process."""
    return {int(n) for n in re.findall(rf"^\s*{re.escape(model)}:(\d+), state", out, re.M)}


def tagged_lines(model, tag):
    lines = (MODEL_DIR / model).read_text().splitlines()
    found = [i + 1 for i, line in enumerate(lines) if f"@{tag}" in line]
    assert found, f"{model} has no line tagged @{tag}"
    return found


@pytest.mark.parametrize(
    "model, wake_points",
    [
        ("doorbell.pml", ["woken", "ppoll_woken"]),
        ("shm_ring.pml", ["data_woken", "space_woken"]),
    ],
)
def test_model_verifies(tmp_path, model, wake_points):
    out = verify(tmp_path, model)
    assert errors(out) == 0, f"{model}: the protocol fails its check:\n{out}"
    # Exhaustive: the whole state space, never cut off by the depth bound.
    assert "Full statespace search" in out, out
    assert "max search depth too small" not in out, out
    assert "Search not completed" not in out, out
    depth = int(re.search(r"depth reached (\d+)", out).group(1))
    assert depth < DEPTH_LIMIT, out
    # Not vacuous: some run sleeps and is woken at each wake point.
    unreached = unreached_lines(out, model)
    for tag in wake_points:
        for line in tagged_lines(model, tag):
            assert line not in unreached, f"{model}:{line} (@{tag}) is never reached:\n{out}"


@pytest.mark.parametrize(
    "model, mutant, failure",
    [
        # lost wake-ups: a sleeper left blocked when every other process has finished
        ("doorbell.pml", "BROKEN_RECHECK", "invalid end state"),
        ("doorbell.pml", "BROKEN_PUBLISH_ORDER", "invalid end state"),
        ("doorbell.pml", "BROKEN_WATCH_LATE", "invalid end state"),
        ("shm_ring.pml", "BROKEN_SPACE_RECHECK", "invalid end state"),
        ("shm_ring.pml", "BROKEN_DATA_RECHECK", "invalid end state"),
        # torn reads: a cell overwritten while a reader holds it
        ("shm_ring.pml", "BROKEN_RELEASE_ORDER", "assertion violated"),
        ("shm_ring.pml", "BROKEN_FASTEST_READER", "assertion violated"),
        ("shm_ring.pml", "BROKEN_CLEAR_UNRESERVED", "assertion violated"),
        # stale records: a header word left from the last lap taken for a new record
        ("shm_ring.pml", "BROKEN_NO_CLEAR", "assertion violated"),
        ("shm_ring.pml", "BROKEN_CLEAR_LATE", "assertion violated"),
    ],
)
def test_mutant_fails(tmp_path, model, mutant, failure):
    # -O0: compiles in a fraction of the time, and a mutant's search stops at its first error.
    out = verify(tmp_path, model, define=mutant, optimize="-O0")
    assert errors(out) > 0, f"{model} with -D{mutant} verifies, so the check would not catch that bug:\n{out}"
    assert f"pan:1: {failure}" in out, f"{model} -D{mutant}: expected '{failure}':\n{out}"
