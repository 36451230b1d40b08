"""A child process in a network namespace that has only loopback, for tools that bind the machine's interface
address themselves (Ray): inside it every socket is on 127.0.0.1 and nothing can leave the machine.

``unavailable()`` says why such a child cannot be started here (None when it can: root and ``unshare``);
``start(argv, **popen_kwargs)`` starts ``argv`` under ``unshare --net``; the child calls ``loopback_up()`` first
(the new namespace's ``lo`` is down), before it opens any socket.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: the interface name, then ifr_flags in the union (40 bytes)


def unavailable() -> str | None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "a loopback-only network namespace needs root and unshare (util-linux)"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace (unshare --net: {probe.stderr.strip()})"
    return None


def start(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """``argv`` in a new network namespace (its own session, so its whole tree can be signalled at once)."""
    return subprocess.Popen(["unshare", "--net", "--", *argv], start_new_session=True, **popen_kwargs)


def loopback_up() -> None:
    """``ip link set lo up`` for this process's namespace, without needing iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]
