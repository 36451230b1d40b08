"""A Ray cluster on simulated nodes: Ray's head on the first node of a :class:`~hotloop.testing.netns.Nodes`, one
``ray start`` per other node joined to it, for tests and benchmarks of executors that span nodes.

Contract:

- ``RayCluster(nodes, log, gpus=0, cpus=2, env=None, node_env=None, resources=None)`` starts the head (port
  ``PORT`` on the first node's address) and every other node's daemon, each with ``--num-cpus`` and
  ``--num-gpus`` (``gpus``: Ray's "GPU" resource, the same on every node or ``{node: count}``, 0 where a node is
  not named; nothing checks that a device exists: the simulated device declares itself so) and the custom
  resources ``resources[name]`` (``--resources``: a node a placement can ask for, or keep a rank off), Ray's
  dashboard, log monitor and usage stats off, their output to ``log``. Every daemon runs with ``env`` (default
  ``os.environ``), ``GLOO_SOCKET_IFNAME`` set to the interface holding its node's address (torch.distributed's
  gloo binds it), ``HOTLOOP_NODE_ID`` set to its node's name (``Nodes.popen``) and ``node_env[name]`` on top. Ray's
  workers inherit their daemon's environment.
- ``address`` is what a driver passes to ``ray.init`` (or ``RAY_ADDRESS``); ``driver_env(node)`` is the
  environment for a process started on a node as a driver. Ray's socket paths live in a short temporary directory
  (AF_UNIX's 107 bytes), removed on ``close()``.
- ``close()`` kills every process left in the nodes' network namespaces (Ray's daemons and workers: each is this
  cluster's) with SIGKILL and removes the directory; the caller closes ``nodes``. Idempotent.
- ``Nodes.unavailable()`` or a missing Ray (``unavailable()``) says why it cannot run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from hotloop.testing.netns import Nodes

PORT = 6379


def unavailable() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'hotloop[ray]')"
    return Nodes.unavailable()


def interface(nodes: Nodes, node: str) -> str:
    """The interface that holds `node`'s address."""
    out = subprocess.run(["ip", "-n", nodes.ns[node], "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    return next(ln.split()[1] for ln in out.splitlines() if f" {nodes.addr[node]}/" in ln)


class RayCluster:
    def __init__(self, nodes: Nodes, log, gpus: int | dict[str, int] = 0, cpus: int = 2, env: dict | None = None,
                 node_env: dict[str, dict] | None = None, resources: dict[str, dict] | None = None):
        self.nodes = nodes
        self.names = list(nodes.ns)
        self.head = self.names[0]
        self.address = f"{nodes.addr[self.head]}:{PORT}"
        self._env = dict(env if env is not None else os.environ)
        self._env.setdefault("RAY_worker_niceness", "0")
        self._node_env = node_env or {}
        self.temp = tempfile.mkdtemp(prefix="hlray")
        start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--num-cpus={cpus}",
                 "--object-store-memory=80000000", "--disable-usage-stats", "--include-log-monitor=false"]
        try:
            for name in self.names:
                where = (["--head", f"--port={PORT}", "--include-dashboard=false"] if name == self.head
                         else [f"--address={self.address}"])
                devices = gpus.get(name, 0) if isinstance(gpus, dict) else gpus
                own = [f"--resources={json.dumps(resources[name])}"] if resources and name in resources else []
                nodes.popen(name, [*start, *where, f"--num-gpus={devices}", *own,
                                   f"--node-ip-address={nodes.addr[name]}", f"--temp-dir={self.temp}/{name}"],
                            env=self.node_env(name), stdout=log, stderr=log)
        except BaseException:
            self.close()
            raise

    def node_env(self, node: str) -> dict:
        """The environment of `node`'s Ray daemon (and so of its workers)."""
        return {**self._env, "GLOO_SOCKET_IFNAME": interface(self.nodes, node), **self._node_env.get(node, {})}

    def driver_env(self, node: str | None = None) -> dict:
        return {**self.node_env(node or self.head), "RAY_ADDRESS": self.address}

    def close(self) -> None:
        for ns in self.nodes.ns.values():
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
