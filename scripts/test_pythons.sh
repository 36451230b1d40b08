#!/usr/bin/env bash
# The Python suite's torch-free part under the other Pythons hotloop supports: 3.10, 3.12 and 3.13 (scripts/test.sh
# runs the whole suite under 3.11, with torch and vLLM). What differs between Pythons is the boundary between the
# C++ core and CPython (thread states, the GIL hand-over, signal checks), so each Python gets its own build of the
# package, as `pip install .` makes it there, and runs every test that needs no torch: waits, the input queue, the
# message queue without tensors (local and remote readers), the notifiers on the fake CUDA driver, metrics, signals,
# serialization. Tests that need torch skip, naming it (tests/conftest.py, require_torch); vLLM's, Ray's and the
# fuzzers' skip as their packages are absent; the Spin model checks (tests/model/) do not depend on Python and are
# left to test.sh.
#
# For each Python: a virtual environment build/venv-pyX.Y (made once, from pyenv's interpreter: on CI machines
# /root/.pyenv/versions/X.Y.*), `pip install --no-build-isolation .` with the package's own dependencies (no torch)
# and the test dependencies that have wheels for every Python; then pytest. The compiler cache (ccache, when
# installed; test.sh installs it) compiles the Python-independent core once for all the builds.
# Environment: HOTLOOP_PYTHONS="3.10 3.12 3.13" (the default) picks the Pythons; HOTLOOP_PYTHONS_STEP=build only
# builds (scripts/test.sh builds them while the other vLLM releases' venvs are still being made), =test only tests
# what is built (each venv must hold its build), unset does both; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
pythons=${HOTLOOP_PYTHONS:-"3.10 3.12 3.13"}
what=${HOTLOOP_PYTHONS_STEP:-both}
case "$what" in build|test|both) ;; *) echo "HOTLOOP_PYTHONS_STEP=$what: build, test, or unset" >&2; exit 2 ;; esac
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_DIR=${CCACHE_DIR:-$root/build/ccache}
  # the same source compiled in another build directory (another Python's) is a hit
  export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
fi
# the NVTX injection recorder built by the C++ suite, when it was (tests/test_nvtx.py skips without it)
recorder="$root/build/cpp-release/tests/cpp/libhotloop_nvtx_recorder.so"
[ -f "$recorder" ] && export HOTLOOP_NVTX_RECORDER="$recorder"

interpreter() {  # X.Y -> the path of a python X.Y, pyenv's newest first
  local found
  found=$(ls -d /root/.pyenv/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -n 1)
  [ -n "$found" ] || found=$(command -v "python$1" || true)
  [ -n "$found" ] && echo "$found"
}

# pytest and the torch-free tests' imports; pyzmq and msgspec come with the package itself
test_deps=(pytest numpy hypothesis prometheus_client)
# One Python at a time: a suite run beside the next Python's build (tried) fails its timing checks, e.g. a woken
# waiter back in Python within 2 ms beside a busy thread (5.2 ms with both cores compiling).
summary=()
for v in $pythons; do
  start=$SECONDS
  py=$(interpreter "$v") || {
    echo "scripts/test_pythons.sh: no Python $v here (pyenv install $v, or set HOTLOOP_PYTHONS)" >&2
    exit 1
  }
  venv="$root/build/venv-py$v"
  if [ "$what" != test ]; then
    echo "== Python $v ($py): build in $venv"
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check scikit-build-core nanobind "${test_deps[@]}"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation .
  fi
  built=$SECONDS
  if [ "$what" = build ]; then
    summary+=("Python $v: built in $((built - start)) s")
    continue
  fi
  if "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    echo "scripts/test_pythons.sh: torch is installed in $venv; these runs are the torch-free ones" >&2
    exit 1
  fi
  echo "== Python $v ($py): the torch-free tests"
  (cd "$root/tests" && "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --ignore=test_model_check.py "$@" \
    "$root/tests") | tee "$root/build/pytest-py$v.log"
  result=$(tail -n 1 "$root/build/pytest-py$v.log" | tr -d '=')
  took="tests $((SECONDS - built)) s"
  [ "$what" = test ] || took="build $((built - start)) s, $took"
  summary+=("Python $v: $result [$took]")
done
printf '%s\n' "${summary[@]}"
