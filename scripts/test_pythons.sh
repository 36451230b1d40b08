#!/usr/bin/env bash
# The Python suite's torch-free part under the other Pythons hotloop supports: 3.10, 3.12 and 3.13 (scripts/test.sh
# runs the whole suite under 3.11, with torch and vLLM). What differs between Pythons is the boundary between the
# C++ core and CPython (thread states, the GIL hand-over, signal checks), so each Python runs the release wheel a
# user of it would install (scripts/build_wheels.sh: cp310 for 3.10, the cp312-abi3 wheel for 3.12 and 3.13),
# installed into a fresh virtual environment with binaries only (no compiler involved), and every test that needs
# no torch: waits, the input queue, the message queue without tensors (local and remote readers), the notifiers on
# the fake CUDA driver, metrics, signals, serialization. pytest runs from tests/, so `import hotloop` finds the
# installed wheel, not python/ (checked before the run). Tests that need torch skip, naming it (tests/conftest.py,
# require_torch); vLLM's, Ray's and the fuzzers' skip as their packages are absent; the Spin model checks
# (tests/model/) do not depend on Python and are left to test.sh.
#
# For each Python: a fresh virtual environment build/venv-pyX.Y (from pyenv's interpreter: on CI machines
# /root/.pyenv/versions/X.Y.*), the package's wheel with its own dependencies (no torch) and the test dependencies
# that have wheels for every Python; then `hotloop info` and pytest.
# Environment: HOTLOOP_PYTHONS="3.10 3.12 3.13" (the default) picks the Pythons; HOTLOOP_PYTHONS_STEP=build only
# installs (scripts/test.sh installs them while the other vLLM releases' venvs are still being made), =test only
# tests what is installed, unset does both; HOTLOOP_WHEELS (build/dist) is where the wheels are: the build step
# builds the x86_64 ones there with scripts/build_wheels.sh unless HOTLOOP_WHEELS_BUILT=1 (scripts/test.sh builds
# them once, for 3.11 too); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
pythons=${HOTLOOP_PYTHONS:-"3.10 3.12 3.13"}
what=${HOTLOOP_PYTHONS_STEP:-both}
case "$what" in build|test|both) ;; *) echo "HOTLOOP_PYTHONS_STEP=$what: build, test, or unset" >&2; exit 2 ;; esac
wheels=${HOTLOOP_WHEELS:-$root/build/dist}
# the NVTX injection recorder built by the C++ suite, when it was (tests/test_nvtx.py skips without it)
recorder="$root/build/cpp-release/tests/cpp/libhotloop_nvtx_recorder.so"
[ -f "$recorder" ] && export HOTLOOP_NVTX_RECORDER="$recorder"

interpreter() {  # X.Y -> the path of a python X.Y, pyenv's newest first
  local found
  found=$(ls -d /root/.pyenv/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -n 1)
  [ -n "$found" ] || found=$(command -v "python$1" || true)
  [ -n "$found" ] && echo "$found"
}

# The wheel a user of Python X.Y gets: its own (cp3XY) or, from 3.12 on, the stable-ABI one.
wheel_for() {
  local tag
  case "$1" in 3.10|3.11) tag="cp${1/./}-cp${1/./}" ;; *) tag="cp312-abi3" ;; esac
  ls "$wheels"/hotloop-*-"$tag"-manylinux_*_"$(uname -m)".whl 2>/dev/null | sort -V | tail -n 1
}

if [ "$what" != test ] && [ "${HOTLOOP_WHEELS_BUILT:-0}" != 1 ]; then
  needed=$(for v in $pythons; do case "$v" in 3.10|3.11) echo "$v" ;; *) echo 3.12 ;; esac; done | sort -u | xargs)
  HOTLOOP_WHEEL_ARCHS=$(uname -m) HOTLOOP_WHEEL_PYTHONS="$needed" HOTLOOP_SDIST=0 HOTLOOP_DIST="$wheels" \
    bash "$root/scripts/build_wheels.sh"
fi

# The 2-minute sustained-loss test is left to scripts/test.sh's run under 3.11: what it checks (ZeroMQ's heartbeats
# on a lossy link, set up and read in C++) is the same on every Python, and it would add 2 minutes a Python to CI.
loss_test="test_network_faults.py::test_sustained_2_percent_loss_keeps_idle_connections_and_a_partition_is_still_seen"
# pytest and the torch-free tests' imports; pyzmq and msgspec come with the package itself
test_deps=(pytest numpy hypothesis prometheus_client)
# The installs one Python at a time, the suites side by side: each suite alone keeps 18-24 % of two cores busy (most
# of its time waits out timeouts, partitions and peers on purpose: test_network_faults.py, 34 of its 75 s, uses 8 %),
# so the three together take little longer than one. Its timing checks are bounded for a loaded 2-core machine
# (medians, or tenths of a second and more). What they do not bear is both cores kept busy for the whole time: a
# suite run beside the next Python's build (tried, when each Python compiled its own) failed them, e.g. a woken
# waiter back in Python within 2 ms beside a busy thread (5.2 ms with both cores compiling). The few millisecond
# checks that need a core free beside them are marked quiet (tests/conftest.py) and run after the suites, alone.
summary=()
for v in $pythons; do
  interpreter "$v" >/dev/null || {
    echo "scripts/test_pythons.sh: no Python $v here (pyenv install $v, or set HOTLOOP_PYTHONS)" >&2
    exit 1
  }
  [ "$what" != test ] || continue
  start=$SECONDS
  py=$(interpreter "$v")
  venv="$root/build/venv-py$v"
  wheel=$(wheel_for "$v")
  [ -n "$wheel" ] || { echo "scripts/test_pythons.sh: no wheel for Python $v in $wheels (scripts/build_wheels.sh)" >&2; exit 1; }
  echo "== Python $v ($py): $(basename "$wheel") into a fresh $venv"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # binaries only: nothing is compiled here (a wheel that did not fit would fail instead of building)
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: "$wheel" "${test_deps[@]}" \
    2>&1 | { grep -v "^WARNING: Location" || true; }
  summary+=("Python $v: installed in $((SECONDS - start)) s")
done
if [ "$what" = build ]; then
  printf '%s\n' "${summary[@]}"
  exit 0
fi

suite() {  # X.Y, pytest arguments...: the checks and the torch-free suite under that Python
  local v=$1 venv="$root/build/venv-py$1"
  shift
  if "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    echo "scripts/test_pythons.sh: torch is installed in $venv; these runs are the torch-free ones" >&2
    return 1
  fi
  # the installed wheel, not the source tree, from where pytest runs; and what `hotloop info` says of it
  (cd "$root/tests" && "$venv/bin/python" -c '
import os, sys, hotloop
where = os.path.dirname(hotloop.__file__)
sys.exit(0 if where.startswith(sys.prefix) else f"hotloop imported from {where}, not from the installed wheel")')
  "$venv/bin/hotloop" info | grep -E "^(hotloop|python|compiler|park_backend) "
  (cd "$root/tests" && "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --ignore=test_model_check.py \
    --deselect "tests/$loss_test" "$@" "$root/tests")
}
start=$SECONDS
declare -A running
for v in $pythons; do
  suite "$v" -m "not quiet" "$@" >"$root/build/pytest-py$v.log" 2>&1 &
  running[$v]=$!
done
failed=()
for v in $pythons; do
  rc=0
  wait "${running[$v]}" || rc=$?
  echo "== Python $v ($(interpreter "$v")): the torch-free tests"
  cat "$root/build/pytest-py$v.log"
  result=$(tail -n 1 "$root/build/pytest-py$v.log" | tr -d '=')
  summary+=("Python $v: $result")
  [ "$rc" = 0 ] || failed+=("$v")
done
summary+=("the suites side by side: $((SECONDS - start)) s")
# the timing checks that need a free core (marked quiet), one Python at a time
start=$SECONDS
for v in $pythons; do
  echo "== Python $v: the torch-free tests marked quiet, alone"
  rc=0
  suite "$v" -m quiet "$@" >"$root/build/pytest-py$v-quiet.log" 2>&1 || rc=$?
  cat "$root/build/pytest-py$v-quiet.log"
  summary+=("Python $v, quiet: $(tail -n 1 "$root/build/pytest-py$v-quiet.log" | tr -d '=')")
  [ "$rc" = 0 ] || failed+=("$v (quiet)")
done
summary+=("the quiet ones: $((SECONDS - start)) s")
printf '%s\n' "${summary[@]}"
[ ${#failed[@]} = 0 ] || { echo "scripts/test_pythons.sh: the torch-free tests failed under Python ${failed[*]}" >&2; exit 1; }
