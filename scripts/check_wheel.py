"""Checks one built wheel the way a release needs it (scripts/build_wheels.sh runs it on each wheel).

    python3 scripts/check_wheel.py WHEEL ARCH VERSION

Fails (exit 1, saying what is wrong) unless:
  - `auditwheel show` finds the wheel consistent with a manylinux tag of glibc 2.28 or older for ARCH, and the
    wheel's own tag is that one (or an older one);
  - every ELF file in it is for ARCH and needs no library beyond glibc's (no libstdc++, no libgcc_s: zig's
    libc++ and libunwind are linked in statically);
  - it holds hotloop/_core (the module) and hotloop/testing/libhotloop_fake_cuda.so;
  - its metadata has VERSION and the vLLM plugin's entry points (vllm.general_plugins: hotloop,
    vllm.platform_plugins: hotloop_sim).
Prints one line: the wheel's name, size, tag found by auditwheel and the libraries its ELF files need.
"""

from __future__ import annotations

import configparser
import os
import re
import struct
import subprocess
import sys
import zipfile

MAX_GLIBC = (2, 28)
E_MACHINE = {62: "x86_64", 183: "aarch64"}
# glibc's own libraries: what the manylinux policies allow a wheel to need from the system, here
GLIBC_LIBS = re.compile(r"^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|ld-linux-aarch64)\.so\.[0-9]+$")


def fail(wheel: str, why: str) -> None:
    sys.exit(f"check_wheel: {os.path.basename(wheel)}: {why}")


def elf_info(data: bytes) -> tuple[str, list[str]]:
    """(architecture, DT_NEEDED names) of a 64-bit little-endian ELF shared object."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return "not a 64-bit little-endian ELF file", []
    machine = struct.unpack_from("<H", data, 18)[0]
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link]
        for k in range(size // entsize):
            tag, val = struct.unpack_from("<qQ", data, offset + k * entsize)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab[4] + val
                needed.append(data[start:data.index(b"\0", start)].decode())
    return E_MACHINE.get(machine, f"machine {machine}"), needed


def main() -> None:
    wheel, arch, version = sys.argv[1:4]
    name = os.path.basename(wheel)
    shown = subprocess.run(["auditwheel", "show", wheel], capture_output=True, text=True)
    text = " ".join((shown.stdout + shown.stderr).split())
    found = re.search(r'consistent with the following platform tag: "(manylinux_(\d+)_(\d+)_(\w+))"', text)
    if shown.returncode != 0 or not found:
        fail(wheel, f"auditwheel show found no manylinux tag: {text}")
    tag, major, minor, tag_arch = found.group(1), int(found.group(2)), int(found.group(3)), found.group(4)
    if tag_arch != arch or (major, minor) > MAX_GLIBC:
        fail(wheel, f"auditwheel show: {tag}, not manylinux_2_28_{arch} or older")
    claimed = re.findall(r"manylinux_(\d+)_(\d+)_(\w+)", name.rsplit("-", 1)[-1])
    if not claimed or any((int(a), int(b)) > (major, minor) or c != arch for a, b, c in claimed):
        fail(wheel, f"its tag claims more than auditwheel found ({tag})")

    libs: set[str] = set()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for required in ("hotloop/testing/libhotloop_fake_cuda.so",):
            if required not in names:
                fail(wheel, f"{required} is missing")
        modules = [n for n in names if re.fullmatch(r"hotloop/_core\.[^/]*so", n)]
        if len(modules) != 1:
            fail(wheel, f"expected one hotloop/_core module, found {modules}")
        if ".abi3." not in modules[0] and f"-{arch}-linux-gnu." not in modules[0]:
            fail(wheel, f"{modules[0]}: its name does not say {arch} (nor abi3)")
        for n in names:
            if not n.endswith(".so"):
                continue
            elf_arch, needed = elf_info(z.read(n))
            if elf_arch != arch:
                fail(wheel, f"{n} is for {elf_arch}, not {arch}")
            outside = [lib for lib in needed if not GLIBC_LIBS.match(lib)]
            if outside:
                fail(wheel, f"{n} needs {outside} (beyond glibc: static libc++ expected)")
            libs.update(needed)
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = z.read(f"{dist_info}/METADATA").decode()
        if f"\nVersion: {version}\n" not in metadata:
            fail(wheel, f"its metadata's version is not {version} (pyproject.toml's)")
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(f"{dist_info}/entry_points.txt").decode())
    for group, key, value in (("vllm.general_plugins", "hotloop", "hotloop.vllm:register"),
                              ("vllm.platform_plugins", "hotloop_sim", "hotloop.vllm:platform_plugin")):
        if entry_points.get(group, key, fallback=None) != value:
            fail(wheel, f"entry point {group}: {key} = {value} missing from its metadata")
    size = os.path.getsize(wheel)
    print(f"{name}  {size / 1024:.0f} KiB; auditwheel: {tag}; needs {', '.join(sorted(libs))}; "
          "vLLM entry points present")


if __name__ == "__main__":
    main()
