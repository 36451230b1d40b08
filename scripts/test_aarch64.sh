#!/usr/bin/env bash
# The C++ core and its GoogleTest suite (tests/cpp) cross-built for aarch64 and run under qemu-user; the aarch64
# cp311 wheel exercised by Debian 12's aarch64 Python 3.11; and the aarch64 cp312-abi3 wheel installed for Debian
# 13's aarch64 Python 3.13, which runs the torch-free pytest suite against it, all under emulation
# (docs/release.md).
#
#   bash scripts/test_aarch64.sh [PYTEST ARGS]   # after scripts/build_wheels.sh (each wheel part is skipped without
#                                                # its wheel); extra arguments go to the abi3 wheel's pytest run
#
# What runs where:
#   - Compiler: zig's clang for aarch64-linux-gnu.2.28 (scripts/zig_toolchain.sh), as the release wheels are
#     built; GoogleTest is built with it from Debian's sources (/usr/src/googletest, package googletest).
#   - The C++ suite: under Debian 12's qemu-user (qemu-aarch64 7.2), with an aarch64 sysroot of Debian 12 packages
#     (libc6, Python 3.11 and what it needs, libzmq and its headers, which the remote-queue tests link) unpacked
#     under build/aarch64/sysroot with dpkg-deb (no multiarch install on this machine: `apt-get download` only;
#     the arm64 architecture is added to apt's sources for that). pkg-config is pointed at that libzmq, not the
#     host's. One process for the suite, the tests in order; it prints the park backend it found: qemu-user
#     implements neither io_uring nor futex_waitv, so the mixed waits fall back to "sliced" and the io_uring /
#     futex_waitv-helper cases skip, naming why, as does the one case that needs a backend which watches a
#     writer's pidfd. An emulator runs the code's instructions with the host's memory model (x86's): it shows the
#     code works on aarch64, not that its barriers are sufficient (that is the ordering review in the headers and
#     tests/cpp/test_ring_litmus.cpp under TSan).
#   - The cp311 wheel: hotloop-*-cp311-cp311-manylinux_*_aarch64.whl from dist/ unpacked with pyzmq's and msgspec's
#     aarch64 wheels (pip download --platform) into a target directory; `hotloop info` and scripts/aarch64_smoke.py
#     (a wait on a flag from another thread, a queue round trip through shared memory between two processes) run
#     under Debian 12's Python 3.11.
#   - The cp312-abi3 wheel, as a user of Python >= 3.12 gets it: Debian 12 has no aarch64 Python >= 3.12, so
#     Debian 13's python3.13 (arm64) and what it needs go to a sysroot of their own (build/aarch64/sysroot-trixie:
#     its glibc is newer than Debian 12's, so the two are not mixed), with Debian 13's qemu-user (10.0, statically
#     linked; amd64), both fetched by an apt of their own (build/aarch64/apt-trixie: its own sources, lists and an
#     empty dpkg status; the host's apt state is not touched). Debian 12's qemu 7.2 aborts when the forked child of
#     a multi-threaded process starts threads (its plugin vCPU hook's assertion), which the queue tests do.
#     build/aarch64/venv-py3.13 is a virtual environment whose python is a host script running the emulated one,
#     so that sys.executable starts an emulated child too (multiprocessing, subprocess); the wheel, its
#     dependencies and the test dependencies (pytest numpy hypothesis prometheus_client, as scripts/test_pythons.sh
#     installs) go there as aarch64 binaries (pip --platform --only-binary). Then, as scripts/test_pythons.sh does:
#     the import is checked to come from the installed wheel, `hotloop info`, the smoke check, and pytest from
#     tests/ on the whole suite but the Spin model checks, with HOTLOOP_EMULATED=qemu-aarch64: the tests that need
#     what qemu-user lacks skip, each saying why (tests/conftest.py, NOT_UNDER_EMULATION: CPU-time bounds, which
#     count the emulator's code translation; a park phase held to the whole timeout; a park backend better than
#     "sliced"; /proc/PID/exe read right after Popen; 1 MiB messages through ZeroMQ within 0.2 s each); those
#     needing torch, vLLM, Ray, py-spy, matplotlib or atheris skip as in test_pythons.sh. The NVTX recorder is the
#     aarch64 one the C++ suite built.
#   - Not run: the cp310 aarch64 wheel. Debian has no aarch64 Python 3.10 (Debian 11: 3.9, 12: 3.11, 13: 3.13),
#     and none can be had here without building one; auditwheel checks that wheel (scripts/build_wheels.sh), and
#     the x86_64 cp310 wheel's suite runs under Python 3.10 (scripts/test_pythons.sh).
# Measured on a 2-core x86_64 machine: from nothing (no build/aarch64, no ccache, another CI run beside it) 9.5
# minutes: GoogleTest and the C++ build 1.5, the C++ suite 0.5, Debian 13's packages and the abi3 wheel's install
# (byte-compiled under emulation) 1.5, the torch-free suite 5.5; built once, on a quiet machine, 6 minutes, the
# suite 4.5 (the network-fault tests about 3 of those: their sustained-loss case lasts 2 minutes anywhere). The
# suite: 254 passed, 55 skipped: 7 under emulation (NOT_UNDER_EMULATION), 11 for the io_uring / futex_waitv park
# backends, 37 for packages not installed (torch 15, vLLM 10, py-spy 6, matplotlib 3, Ray 2, atheris 1).
# Environment: HOTLOOP_STRESS_SCALE (1) as for the suite; HOTLOOP_DIST (dist) where the wheels are;
# HOTLOOP_AARCH64_SUITE_TIMEOUT (2400) the seconds the abi3 wheel's pytest run may take.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work="$root/build/aarch64"
dist=${HOTLOOP_DIST:-$root/dist}
mkdir -p "$work"
start=$SECONDS
step() { echo "== $* (at $((SECONDS - start)) s)"; }

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
command -v qemu-aarch64 >/dev/null || {
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq qemu-user >/dev/null
}
[ -d /usr/src/googletest ] || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq googletest >/dev/null

# The sysroot: Debian 12's aarch64 glibc, libstdc++ (for nothing of ours: Python's modules, libzmq), Python 3.11,
# and libzmq with its headers and libraries (the C++ suite's remote-queue tests link it to make their sockets).
sysroot="$work/sysroot"
debs=(libc6 libgcc-s1 libstdc++6 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libexpat1 zlib1g
  libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libdb5.3 libnsl2
  libtirpc3 libcrypt1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libcom-err2 libkrb5support0 libkeyutils1
  libzmq5 libzmq3-dev libsodium23 libpgm-5.3-0 libnorm1 libbsd0 libmd0)
if [ ! -x "$sysroot/usr/bin/python3.11" ] || [ ! -e "$sysroot/usr/include/zmq.h" ]; then
  step "aarch64 sysroot from Debian packages"
  dpkg --print-foreign-architectures | grep -qx arm64 || { $sudo dpkg --add-architecture arm64; $sudo apt-get update -qq; }
  mkdir -p "$work/debs"
  (cd "$work/debs" && apt-get download "${debs[@]/%/:arm64}" >/dev/null 2>&1) || {
    $sudo apt-get update -qq && (cd "$work/debs" && apt-get download "${debs[@]/%/:arm64}" >/dev/null)
  }
  rm -rf "$sysroot"
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
fi
export QEMU_LD_PREFIX="$sysroot"  # qemu-aarch64 -L: the aarch64 dynamic loader and libraries

tools="$root/build/wheel-build/tools"
if [ ! -x "$tools/bin/python" ]; then
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check ziglang==0.17.1 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
zig=$("$tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
toolchain=$(HOTLOOP_QEMU_SYSROOT="$sysroot" bash "$root/scripts/zig_toolchain.sh" "$zig" aarch64 "$work/zig")
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_DIR=${CCACHE_DIR:-$root/build/ccache} CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
fi

if [ ! -f "$work/gtest/lib/cmake/GTest/GTestConfig.cmake" ]; then
  step "GoogleTest for aarch64 (Debian's sources)"
  cmake -S /usr/src/googletest -B "$work/gtest-build" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$toolchain" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$work/gtest" -DBUILD_GMOCK=OFF >/dev/null
  cmake --build "$work/gtest-build" -j 2 >/dev/null
  cmake --install "$work/gtest-build" >/dev/null
fi

step "C++ suite for aarch64: build"
# pkg-config finds the sysroot's aarch64 libzmq, not the host's (whose -I/usr/include would put the host's C headers
# before zig's libc++ ones); the configure starts from a fresh cache so no host result is kept.
mkdir -p "$work/pkgconfig"
cat >"$work/pkgconfig/libzmq.pc" <<EOF
Name: libzmq
Description: Debian 12's aarch64 libzmq in $sysroot
Version: $(sed -n 's/^Version: *//p' "$sysroot/usr/lib/aarch64-linux-gnu/pkgconfig/libzmq.pc")
Cflags: -I$sysroot/usr/include
Libs: -L$sysroot/usr/lib/aarch64-linux-gnu -lzmq
EOF
rm -f "$work/cpp/CMakeCache.txt"
PKG_CONFIG_LIBDIR="$work/pkgconfig" PKG_CONFIG_PATH="" cmake -S "$root" -B "$work/cpp" -G Ninja \
  -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DCMAKE_BUILD_TYPE=Release -DHOTLOOP_BUILD_TESTS=ON \
  -DCMAKE_PREFIX_PATH="$work/gtest" -DGTest_DIR="$work/gtest/lib/cmake/GTest" >/dev/null
cmake --build "$work/cpp" -j 2 --target hotloop_tests
file -b "$work/cpp/tests/cpp/hotloop_tests" | cut -d, -f1-2

step "C++ suite for aarch64: run under $(qemu-aarch64 --version | head -n 1)"
# One process, the tests in order (timing checks then compete with nothing of ours); the suite prints the park
# backend its mixed waits use (ParkBackend.NamesTheBackendInUse), and each skipped test says why. Left out, as
# the emulator cannot do what they check (each runs in the x86_64 suites):
#   - Nvtx.*: they run the aarch64 probe program from the test (execve of an aarch64 binary from an emulated
#     process needs binfmt_misc, which this machine does not have);
#   - WaitAny.DescriptorClosedWhileWaitedOnRaises*, ParkBackends.DescriptorClosedWhileWaitedOn*: they wait until
#     the waiter is asleep in ppoll / futex_waitv by reading /proc/TID/syscall, which shows the host's system
#     call under qemu (x86_64's numbers), never the aarch64 one.
excluded="Nvtx.*:WaitAny.DescriptorClosedWhileWaitedOnRaises*:*ParkBackends.DescriptorClosedWhileWaitedOn*"
log="$work/cpp-tests.log"
rc=0
(cd "$work/cpp/tests/cpp" && qemu-aarch64 ./hotloop_tests --gtest_color=no --gtest_filter="-$excluded") >"$log" 2>&1 ||
  rc=$?
echo "left out (the emulator cannot run what they check; see above): $excluded"
grep -E "^hotloop park backend" "$log" || true
# the skipped tests, counted by reason (gtest prints "file:line: Skipped", the reason, then "[  SKIPPED ] name (N ms)")
awk '/: Skipped$/ {getline why; reason = why} /^\[  SKIPPED \] .* \([0-9]+ ms\)$/ {print reason}' "$log" |
  sort | uniq -c | sed 's/^ */  skipped: /'
grep -E "^\[  SKIPPED \] .* \([0-9]+ ms\)$" "$log" | sed 's/^\[  SKIPPED \] /    /; s/ ([0-9]* ms)$//'

grep -E "^\[  FAILED  \] [A-Za-z]" "$log" || true
grep -E "^\[==========\] [0-9]+ tests? from|^\[  (PASSED  |SKIPPED |FAILED  )\] [0-9]+ tests?" "$log" || true
[ "$rc" = 0 ] || { echo "the aarch64 C++ suite failed (log: $log)"; exit 1; }

wheel=$(ls "$dist"/hotloop-*-cp311-cp311-manylinux_*_aarch64.whl 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$wheel" ]; then
  echo "== no aarch64 cp311 wheel in $dist (scripts/build_wheels.sh makes it): the wheel part is skipped"
else
  step "the aarch64 wheel under Debian's aarch64 Python 3.11: $(basename "$wheel")"
  site="$work/site-py3.11"
  rm -rf "$site"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$site" --platform manylinux_2_28_aarch64 --platform manylinux_2_24_aarch64 --platform manylinux2014_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all: "pyzmq>=25" "msgspec>=0.18" "$wheel" \
    --root-user-action=ignore 2>&1 | { grep -v "^WARNING: Location" || true; }
  py=(qemu-aarch64 "$sysroot/usr/bin/python3.11")
  # out of the source tree: the import must find the unpacked wheel, not python/
  (cd "$work" && PYTHONPATH="$site" PYTHONHOME="$sysroot/usr" "${py[@]}" -c 'import sys; sys.argv = ["hotloop", "info"]; from hotloop.cli import main; main()')
  (cd "$work" && PYTHONPATH="$site" PYTHONHOME="$sysroot/usr" "${py[@]}" "$root/scripts/aarch64_smoke.py")
fi

abi3=$(ls "$dist"/hotloop-*-cp312-abi3-manylinux_*_aarch64.whl 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$abi3" ]; then
  echo "== no aarch64 cp312-abi3 wheel in $dist (scripts/build_wheels.sh makes it): its suite is skipped"
else
  # Debian 13's arm64 Python 3.13 and its libraries, and Debian 13's qemu-user (amd64, statically linked), from an
  # apt state of their own under $work/apt-trixie: the host's apt (its sources, lists, dpkg status) is not touched.
  # The mirrors are the host's Debian ones, with trixie for the host's release.
  trixie="$work/sysroot-trixie"
  qemu13="$work/qemu-trixie/usr/bin/qemu-aarch64"
  if [ ! -x "$trixie/usr/bin/python3.13" ] || [ ! -x "$qemu13" ]; then
    step "Debian 13's aarch64 Python 3.13 and qemu-user from Debian packages"
    apt13="$work/apt-trixie"
    rm -rf "$apt13" "$trixie" "$work/qemu-trixie"
    mkdir -p "$apt13"/{lists/partial,cache/archives/partial,parts.d,preferences.d,debs}
    : >"$apt13/status"
    codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg  # Debian 12's holds Debian 13's keys
    apt-get indextargets --format '$(REPO_URI) $(RELEASE)' "Created-By: Packages" "Component: main" | sort -u |
      while read -r uri release; do
        case "$release" in
          "$codename"|"$codename"-updates|"$codename"-security)
            echo "deb [arch=arm64,amd64 signed-by=$keyring] $uri trixie${release#"$codename"} main" ;;
        esac
      done >"$apt13/sources.list"
    [ -s "$apt13/sources.list" ] || {
      echo "no Debian $codename mirror in apt's sources to take trixie from" >&2
      exit 1
    }
    apt13_opts=(-o APT::Architecture=arm64 -o APT::Architectures::=arm64 -o APT::Architectures::=amd64
      -o Dir::Etc::SourceList="$apt13/sources.list" -o Dir::Etc::SourceParts="$apt13/parts.d"
      -o Dir::Etc::PreferencesParts="$apt13/preferences.d" -o Dir::State::Lists="$apt13/lists"
      -o Dir::State::Status="$apt13/status" -o Dir::Cache="$apt13/cache" -o Debug::NoLocking=1
      -o APT::Sandbox::User=root)
    apt-get "${apt13_opts[@]}" update -qq >/dev/null
    # the interpreter, its standard library and what they need (an empty dpkg status: the whole closure), and
    # libstdc++ for pyzmq's libzmq
    apt-get "${apt13_opts[@]}" install -y -qq --download-only --no-install-recommends python3.13-minimal \
      libpython3.13-stdlib libstdc++6 >/dev/null
    (cd "$apt13/debs" && apt-get "${apt13_opts[@]}" download qemu-user:amd64 >/dev/null)
    for deb in "$apt13"/cache/archives/*.deb; do dpkg-deb -x "$deb" "$trixie"; done
    for d in bin sbin lib; do [ -e "$trixie/$d" ] || ln -s "usr/$d" "$trixie/$d"; done  # merged /usr
    dpkg-deb -x "$apt13"/debs/qemu-user_*_amd64.deb "$work/qemu-trixie"
  fi
  step "the aarch64 abi3 wheel under Debian 13's aarch64 Python 3.13: $(basename "$abi3")"
  "$qemu13" --version | head -n 1
  # A virtual environment whose interpreter is a host script running the emulated one: sys.executable names the
  # script, so a child Python (multiprocessing, subprocess.run([sys.executable, ...])) runs emulated too, which the
  # kernel could not do for an aarch64 executable without binfmt_misc.
  venv="$work/venv-py3.13"
  site="$venv/lib/python3.13/site-packages"
  rm -rf "$venv"
  mkdir -p "$venv/bin" "$site"
  printf 'home = %s\ninclude-system-site-packages = false\nversion = 3.13\n' "$trixie/usr/bin" >"$venv/pyvenv.cfg"
  printf '#!/bin/sh\nexec "%s" -L "%s" -0 "$0" "%s" "$@"\n' "$qemu13" "$trixie" "$trixie/usr/bin/python3.13" \
    >"$venv/bin/python"
  chmod +x "$venv/bin/python"
  ln -s python "$venv/bin/python3"
  # the wheel, its dependencies and the torch-free tests' (scripts/test_pythons.sh), binaries for aarch64 only
  python3 -m pip install -q --disable-pip-version-check --target "$site" --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_24_aarch64 --platform manylinux2014_aarch64 --python-version 3.13 --implementation cp \
    --abi cp313 --abi abi3 --abi none --only-binary=:all: "$abi3" pytest numpy hypothesis prometheus_client \
    --root-user-action=ignore 2>&1 | { grep -v "^WARNING: Location" || true; }
  # byte-compiled once: with PYTHONDONTWRITEBYTECODE set, each emulated process would compile what it imports
  "$venv/bin/python" -m compileall -q -j 2 "$trixie/usr/lib/python3.13" "$site" >/dev/null
  step "the abi3 wheel: hotloop info and the smoke check"
  (cd "$root/tests" && "$venv/bin/python" -c '
import os, sys, hotloop
where = os.path.dirname(hotloop.__file__)
sys.exit(0 if where.startswith(sys.prefix) else f"hotloop imported from {where}, not from the installed wheel")')
  (cd "$work" && "$venv/bin/python" -c 'import sys; sys.argv = ["hotloop", "info"]; from hotloop.cli import main; main()')
  (cd "$work" && "$venv/bin/python" "$root/scripts/aarch64_smoke.py")
  step "the abi3 wheel: the torch-free suite under emulation"
  recorder="$work/cpp/tests/cpp/libhotloop_nvtx_recorder.so"  # the aarch64 one, built with the C++ suite
  [ -f "$recorder" ] && export HOTLOOP_NVTX_RECORDER="$recorder"
  log="$work/pytest-py3.13.log"
  rc=0
  # -rs: each skip with how many, where and why (the emulator's, the missing packages', the park backends')
  (cd "$root/tests" && HOTLOOP_EMULATED=qemu-aarch64 timeout "${HOTLOOP_AARCH64_SUITE_TIMEOUT:-2400}" \
    "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --ignore=test_model_check.py "$@" "$root/tests") 2>&1 |
    tee "$log" || rc=$?
  [ "$rc" = 0 ] || { echo "the aarch64 abi3 wheel's suite failed (rc $rc; log: $log)"; exit 1; }
fi
echo "== aarch64 done in $((SECONDS - start)) s"
