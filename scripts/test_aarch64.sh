#!/usr/bin/env bash
# The C++ core and its GoogleTest suite (tests/cpp) cross-built for aarch64 and run under qemu-user, and the
# aarch64 wheel imported and exercised by Debian's aarch64 Python 3.11 under the same emulation (docs/release.md).
#
#   bash scripts/test_aarch64.sh     # after scripts/build_wheels.sh (for the wheel part; skipped without it)
#
# What runs where:
#   - Compiler: zig's clang for aarch64-linux-gnu.2.28 (scripts/zig_toolchain.sh), as the release wheels are
#     built; GoogleTest is built with it from Debian's sources (/usr/src/googletest, package googletest).
#   - Emulator: Debian's qemu-user (qemu-aarch64), with an aarch64 sysroot of Debian packages (libc6, Python 3.11
#     and what it needs) unpacked under build/aarch64/sysroot with dpkg-deb (no multiarch install on this
#     machine: `apt-get download` only; the arm64 architecture is added to apt's sources for that).
#   - The suite runs in one process per test binary, the tests in order; each prints the park backend it found:
#     qemu-user implements neither io_uring nor futex_waitv, so the mixed waits fall back to "sliced" and the
#     io_uring / futex_waitv-helper cases skip, naming why. An emulator runs the code's instructions with the host's
#     memory model (x86's): it shows the code works on aarch64, not that its barriers are sufficient (that is the
#     ordering review in the headers and tests/cpp/test_ring_litmus.cpp under TSan).
#   - The wheel: hotloop-*-cp311-cp311-manylinux_*_aarch64.whl from dist/ unpacked with pyzmq's and msgspec's
#     aarch64 wheels (pip download --platform) into a target directory; `hotloop info` and a short exercise of
#     the module (a wait on a flag from another thread, a queue round trip through shared memory between two
#     processes) run under qemu. The cp312-abi3 aarch64 wheel needs an aarch64 Python >= 3.12, which neither
#     Debian 12 nor PyPI offers here: it is checked by auditwheel only (scripts/build_wheels.sh).
# Environment: HOTLOOP_STRESS_SCALE (1) as for the suite; HOTLOOP_DIST (dist) where the wheels are.
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

# The sysroot: Debian 12's aarch64 glibc, libstdc++ (for nothing of ours: Python's modules) and Python 3.11.
sysroot="$work/sysroot"
debs=(libc6 libgcc-s1 libstdc++6 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libexpat1 zlib1g
  libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libdb5.3 libnsl2
  libtirpc3 libcrypt1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libcom-err2 libkrb5support0 libkeyutils1)
if [ ! -x "$sysroot/usr/bin/python3.11" ]; then
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
cmake -S "$root" -B "$work/cpp" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DCMAKE_BUILD_TYPE=Release \
  -DHOTLOOP_BUILD_TESTS=ON -DCMAKE_PREFIX_PATH="$work/gtest" -DGTest_DIR="$work/gtest/lib/cmake/GTest" >/dev/null
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
tail -n 4 "$log"
[ "$rc" = 0 ] || { echo "the aarch64 C++ suite failed (log: $log)"; exit 1; }

wheel=$(ls "$dist"/hotloop-*-cp311-cp311-manylinux_*_aarch64.whl 2>/dev/null | head -n 1 || true)
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
echo "== aarch64 done in $((SECONDS - start)) s"
