"""Network namespaces for tests: a loopback-only child, and simulated nodes joined by links that can be cut.

- A child process in a network namespace that has only loopback, for tools that bind the machine's interface
  address themselves (Ray): inside it every socket is on 127.0.0.1 and nothing can leave the machine.
  ``unavailable()`` says why such a child cannot be started here (None when it can: root and ``unshare``);
  ``start(argv, **popen_kwargs)`` starts ``argv`` under ``unshare --net``; the child calls ``loopback_up()``
  first (the new namespace's ``lo`` is down), before it opens any socket.
- :class:`Nodes`: named network namespaces ("nodes"), each joined to the first by its own veth pair with an
  address in 10.<n>.0.0/24, so the only traffic between them crosses links the test owns (the first node
  forwards between the others). ``cut(node)`` drops
  every packet in and out of a node over its link (an nftables drop-all table: a partition, no process is told;
  its loopback is left alone), ``lose(node, percent)`` drops that share of them at random, ``heal(node)`` removes
  either;
  ``popen(node, argv)`` starts a process on a node (``HOTLOOP_NODE_ID`` set to its name); a process started
  otherwise (multiprocessing's spawn) moves itself onto one with ``join(nodes.path(node))`` before it opens any
  socket (``HOTLOOP_NODE_ID`` set to the node's namespace). ``Nodes.unavailable()`` says why they cannot be made
  here (root, iproute2's ``ip``, Debian's ``nftables``). Everything is removed on ``close()``.
"""

from __future__ import annotations

import fcntl
import itertools
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


_CLONE_NEWNET = 0x40000000


def join(path: str) -> None:
    """Move this process's calling thread into the network namespace at ``path`` (``Nodes.path``), and name the
    process's node after it (``HOTLOOP_NODE_ID``: the simulated nodes share ``/dev/shm`` and the boot id, and a
    queue's readers on different nodes must not share a relay). Call it first in a child, before any socket or
    thread exists. Needs CAP_SYS_ADMIN (root)."""
    os.environ["HOTLOOP_NODE_ID"] = os.path.basename(path)
    import ctypes

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot join the network namespace {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


# A node's rules act on its link, never on its loopback: a partition or a lossy link cuts a node off from the
# others, not its processes from each other (a reader and its node's relay or delay proxy talk over 127.0.0.1).
_CUT = """table inet hotloop_cut {
  chain in { type filter hook input priority -100; policy drop; iifname "lo" accept; }
  chain out { type filter hook output priority -100; policy drop; oifname "lo" accept; }
}
"""
_NODE_SETS = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Nodes:
    """Simulated nodes: ``Nodes(["writer", "reader0", ...])``; ``addr[name]`` is each node's address (the first
    node's is the hub of a star of veth links). Use as a context manager."""

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "simulated nodes need root (network namespaces, veth pairs, nftables)"
        missing = [tool for tool in ("ip", "nft") if not shutil.which(tool)]
        if missing:
            return f"simulated nodes need {' and '.join(missing)} (Debian: iproute2, nftables)"
        return None

    def __init__(self, names: list[str]):
        why = self.unavailable()
        if why:
            raise RuntimeError(why)
        self.tag = f"hl{os.getpid()}x{next(_NODE_SETS)}"
        self.ns = {name: f"{self.tag}-{i}" for i, name in enumerate(names)}
        self.addr: dict[str, str] = {}
        self._procs: list[subprocess.Popen] = []
        self.on_close: list = []  # called after the processes ended, before the namespaces go
        subnet = 10 + os.getpid() % 200  # one /16 per test process, one /24 per link
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            hub_name, hub = names[0], self.ns[names[0]]
            for i, name in enumerate(names[1:], start=1):
                a, b = f"h{i}", f"n{i}"  # the hub's end, the node's end
                _ip("link", "add", a, "netns", hub, "type", "veth", "peer", "name", b, "netns", self.ns[name])
                _ip("-n", hub, "addr", "add", f"10.{subnet}.{i}.1/24", "dev", a)
                _ip("-n", self.ns[name], "addr", "add", f"10.{subnet}.{i}.2/24", "dev", b)
                _ip("-n", hub, "link", "set", a, "up")
                _ip("-n", self.ns[name], "link", "set", b, "up")
                _ip("-n", self.ns[name], "route", "add", "default", "via", f"10.{subnet}.{i}.1")
                self.addr[name] = f"10.{subnet}.{i}.2"
            # the hub's address on the first link (a node on another link reaches it through its default route)
            self.addr[hub_name] = f"10.{subnet}.1.1" if len(names) > 1 else "127.0.0.1"
            if len(names) > 2:  # the other nodes reach each other through the hub
                subprocess.run(["ip", "netns", "exec", hub, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True,
                               capture_output=True)
        except BaseException:
            self.close()
            raise

    def path(self, node: str) -> str:
        """The node's namespace file, for ``join``."""
        return f"/run/netns/{self.ns[node]}"

    def popen(self, node: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` on ``node``, with ``HOTLOOP_NODE_ID`` set to the node's name: the simulated nodes share this
        host's ``/dev/shm`` and boot id, and a queue's readers on different nodes must not share a relay."""
        kwargs["env"] = {**(kwargs.get("env") or os.environ), "HOTLOOP_NODE_ID": node}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[node], *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def cut(self, node: str) -> None:
        """Drop every packet in and out of ``node`` over its link from now on (its processes keep running, and
        keep talking to each other over its loopback)."""
        subprocess.run(["ip", "netns", "exec", self.ns[node], "nft", "-f", "-"], input=_CUT, text=True, check=True,
                       capture_output=True)

    def lose(self, node: str, percent: int, steady: bool = False) -> None:
        """Drop ``percent`` % of the packets in and out of ``node`` over its link, at random (until ``heal``).
        ``steady``: in a table of its own that ``cut`` and ``heal`` leave alone, for the node's whole life (a lossy
        link under the other faults)."""
        rule = f"numgen random mod 100 < {int(percent)} drop"
        table = ("table inet " + ("hotloop_loss" if steady else "hotloop_cut") + " {\n"
                 f"  chain in {{ type filter hook input priority -100; policy accept; iifname != \"lo\" {rule}; }}\n"
                 f"  chain out {{ type filter hook output priority -100; policy accept; oifname != \"lo\" {rule}; }}\n"
                 "}\n")
        subprocess.run(["ip", "netns", "exec", self.ns[node], "nft", "-f", "-"], input=table, text=True, check=True,
                       capture_output=True)

    def heal(self, node: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns[node], "nft", "delete", "table", "inet", "hotloop_cut"],
                       check=True, capture_output=True)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for hook in self.on_close:
            hook()
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)  # its veth ends go with it

    def __enter__(self) -> "Nodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
