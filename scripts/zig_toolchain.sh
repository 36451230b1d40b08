#!/usr/bin/env bash
# Writes a CMake toolchain for building hotloop against an old glibc with zig's clang (the PyPI package ziglang:
# no Docker, no manylinux image, no cross gcc): scripts/build_wheels.sh and scripts/test_aarch64.sh use it.
#
#   scripts/zig_toolchain.sh ZIG ARCH DIR    # ZIG: the zig binary; ARCH: x86_64 | aarch64; DIR: where to write
#
# DIR gets cc, c++, ar and ranlib wrappers and toolchain.cmake (pass it as CMAKE_TOOLCHAIN_FILE). The target is
# ARCH-linux-gnu.2.28: zig links against stubs of glibc 2.28's symbols, so nothing built with it needs a newer
# glibc (manylinux_2_28, the policy auditwheel then checks). C++ comes from zig's libc++ and libunwind, linked
# statically: a binary or module built here needs no libstdc++ or libgcc_s on the user's machine.
# Optimisation flags come from CMake (Release: -O3); zig would otherwise add UBSan traps to unoptimised builds,
# which -fno-sanitize=all turns off (the sanitizer builds are the host's g++ builds, scripts/test.sh).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 ZIG ARCH DIR" >&2; exit 2; }
zig=$1 arch=$2 dir=$3
case "$arch" in x86_64|aarch64) ;; *) echo "$0: ARCH must be x86_64 or aarch64, not $arch" >&2; exit 2 ;; esac
glibc=2.28
target="$arch-linux-gnu.$glibc"
mkdir -p "$dir"
for tool in cc c++; do
  cat >"$dir/$tool" <<EOF
#!/bin/sh
exec "$zig" $tool -target $target -fno-sanitize=all "\$@"
EOF
done
for tool in ar ranlib; do
  printf '#!/bin/sh\nexec "%s" %s "$@"\n' "$zig" "$tool" >"$dir/$tool"
done
chmod +x "$dir/cc" "$dir/c++" "$dir/ar" "$dir/ranlib"
cat >"$dir/toolchain.cmake" <<EOF
# Written by scripts/zig_toolchain.sh: $target with zig $("$zig" version).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR $arch)
set(CMAKE_C_COMPILER "$dir/cc")
set(CMAKE_CXX_COMPILER "$dir/c++")
set(CMAKE_AR "$dir/ar" CACHE FILEPATH "zig ar")
set(CMAKE_RANLIB "$dir/ranlib" CACHE FILEPATH "zig ranlib")
# Host programs and packages (Python, nanobind's CMake files, GTest built for the target under a prefix) are
# found as usual: there is no target sysroot beyond zig's own libc stubs.
EOF
if [ "$arch" != "$(uname -m)" ]; then
  # Lets CMake run target programs (gtest_discover_tests lists an aarch64 test binary) under qemu-user.
  sysroot=${HOTLOOP_QEMU_SYSROOT:-}
  echo "set(CMAKE_CROSSCOMPILING_EMULATOR qemu-$arch${sysroot:+ -L \"$sysroot\"})" >>"$dir/toolchain.cmake"
fi
echo "$dir/toolchain.cmake"
