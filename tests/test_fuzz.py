"""Fuzzing in CI: each target of tests/fuzz/ replays its saved corpus, then fuzzes for a bounded time (12 s).

Each target runs as its own process (python tests/fuzz/fuzz_<target>.py, an atheris/libFuzzer fuzzer): a crash,
a hang (-timeout) or an input that breaks the contract fails the test with the fuzzer's report and the input,
saved under the test's tmp_path. Inputs found along the way go to a scratch directory, never to the saved corpus.
The reproducers of known, unfixed findings (tests/fuzz/known/) are replayed with HOTLOOP_FUZZ_STRICT=1 and are
expected to fail until their fix lands (then the xfail turns into an error: move the file into the corpus).
Long runs and the findings: tests/fuzz/README.md.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parent / "fuzz"
TARGETS = ["serialization", "protocol", "handle"]
SECONDS = int(os.environ.get("HOTLOOP_FUZZ_SECONDS", "12"))

pytest.importorskip("atheris")


def _run(target: str, args: list[str], env: dict | None = None, timeout: float = 180):
    return subprocess.run([sys.executable, str(FUZZ / f"fuzz_{target}.py"), *args], cwd=FUZZ.parent.parent,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target(target, tmp_path):
    corpus = FUZZ / "corpus" / target
    assert len(list(corpus.iterdir())) >= 20, f"saved corpus {corpus} is missing: run tests/fuzz/make_corpus.py"
    scratch = tmp_path / "new"
    scratch.mkdir()
    r = _run(target, [f"-max_total_time={SECONDS}", "-print_final_stats=1", f"-artifact_prefix={tmp_path}/",
                      str(scratch), str(corpus)], timeout=SECONDS + 120)
    found = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-", "leak-")))
    assert r.returncode == 0 and not found, (
        f"fuzz_{target} found a problem (inputs {found} in {tmp_path}; rc {r.returncode}):\n"
        f"{(r.stdout + r.stderr)[-6000:]}")
    assert "INITED" in r.stderr, f"fuzz_{target} did not replay its corpus:\n{r.stderr[-3000:]}"


KNOWN = sorted((t, p.name) for t in TARGETS if (FUZZ / "known" / t).is_dir() for p in (FUZZ / "known" / t).iterdir())

_REPLAY = """
import os, sys
sys.path.insert(0, sys.argv[1])
import _common
harness = __import__("fuzz_" + sys.argv[2])
for path in sys.argv[3:]:
    try:
        harness.TestOneInput(open(path, "rb").read())
        print("PASSES", os.path.basename(path))
    except _common.Finding as e:
        print("KNOWN" if "known finding (HOTLOOP_FUZZ_STRICT)" in str(e) else "OTHER", os.path.basename(path), e)
    sys.stdout.flush()
if hasattr(harness, "WRITERS"):
    harness.WRITERS.close()
"""


@functools.cache
def _replay_known(target: str) -> dict[str, str]:
    """Each known reproducer of `target` run once, strictly, in one process: {name: KNOWN / PASSES / OTHER ...}."""
    files = sorted(str(p) for p in (FUZZ / "known" / target).iterdir())
    r = subprocess.run([sys.executable, "-c", _REPLAY, str(FUZZ), target, *files], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "HOTLOOP_FUZZ_STRICT": "1"}, cwd=FUZZ.parent.parent)
    results = {line.split(" ", 2)[1]: line for line in r.stdout.splitlines()
               if line.startswith(("KNOWN ", "PASSES ", "OTHER "))}
    for p in files:
        results.setdefault(os.path.basename(p), f"CRASHED rc {r.returncode}: {r.stderr[-3000:]}")
    return results


class KnownFindingReproduces(AssertionError):
    pass


@pytest.mark.xfail(strict=True, raises=KnownFindingReproduces,
                   reason="known finding, not fixed yet (tests/fuzz/README.md)")
@pytest.mark.parametrize("target,name", KNOWN)
def test_known_finding_still_reproduces(target, name):
    result = _replay_known(target)[name]
    if result.startswith("KNOWN "):
        raise KnownFindingReproduces(result[:500])
    assert result.startswith("PASSES "), f"{name}: {result}"


_SUBSCRIBER_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import fuzz_handle
import hotloop

def raised(call):
    try:
        call()
    except Exception as e:
        return e
    raise AssertionError("no exception")

class Other:
    def __init__(self):
        raise RuntimeError("another __init__")

cases = {
    # out of RemoteSubscriber.__init__ (a rank of the wrong type fails there before any socket is made)
    "subscriber": raised(lambda: fuzz_handle.RemoteSubscriber("tcp://127.0.0.1:1", "x", "q", b"k" * 40,
                                                               (b"k" * 40, b"k" * 40))),
    # out of create_from_handle before any reader is made, and out of some other __init__
    "handle check": fuzz_handle.attach("not a handle", 0),
    "other init": raised(Other),
    "none": None,
}
for name, e in cases.items():
    print(name, "->", fuzz_handle._raised_in_remote_subscriber(e))
"""


def test_the_handle_harness_recognises_an_error_of_the_remote_subscriber():
    """fuzz_handle's F5 check (`_raised_in_remote_subscriber`) says True for an exception that came out of
    RemoteSubscriber.__init__ and False for others: a check that can no longer say True (say, one matching a file
    the class has left) fails here."""
    r = subprocess.run([sys.executable, "-c", _SUBSCRIBER_CHECK, str(FUZZ)], capture_output=True, text=True,
                       timeout=120, cwd=FUZZ.parent.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    said = dict(line.split(" -> ") for line in r.stdout.splitlines() if " -> " in line)
    assert said == {"subscriber": "True", "handle check": "False", "other init": "False", "none": "False"}, r.stdout
