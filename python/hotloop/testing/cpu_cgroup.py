"""CpuCgroup: a cgroup with a CFS CPU quota, as a container with a CPU limit has one, for tests and benchmarks.

Contract:

- ``CpuCgroup.unavailable()`` says why no such cgroup can be made here (None when it can): root and a writable cpu
  controller, v2 (``cpu.max`` under a cgroup2 mount with the cpu controller enabled) or v1 (``cpu.cfs_quota_us``
  under the cpu controller's mount). Callers skip with that reason.
- ``CpuCgroup(cores)`` makes a fresh cgroup (``hotloop-<pid>-<n>``) under the controller's root with a quota of
  ``cores`` (``cores * period`` per 100 ms period: 1.5 -> 150000 of 100000 us), the way Kubernetes turns
  ``resources.limits.cpu`` into ``cpu.max``. ``add(pid)`` moves a process into it; its children started after
  that are born in it (a server started by a process already inside is wholly inside). ``pids()`` lists the
  processes in it now.
- ``contained(argv)``: the command line that starts `argv` inside the cgroup named by ``HOTLOOP_CPU_CGROUP`` (or
  the path given), born in it, children and all; ``cpu_stat(path)`` / ``stat_delta``: a cgroup's counters by path
  (the bench's driver reads its own around each load shape).
- ``stat()``: ``{"periods": n, "throttled_periods": n, "throttled_s": s, "usage_s": s}`` since it was made
  (v2 ``cpu.stat``; v1 ``cpu.stat`` and ``cpuacct.usage`` where the cpuacct controller shares the mount, else
  ``usage_s`` is None).
- ``close()`` (also on leaving ``with``, and on an exception inside it) moves every process still in it back to
  the root cgroup and removes it; calling it again does nothing. A cgroup left by a killed run is named by its
  pid, so ``remove_stale()`` removes those whose creator is gone.
"""

from __future__ import annotations

import itertools
import os
import time

from hotloop import host_cpu

ENV = "HOTLOOP_CPU_CGROUP"  # a cgroup folder: contained() starts processes in it (the bench's pod regime)
_counter = itertools.count()
_PERIOD_US = 100_000  # the kernel's and Kubernetes' default CFS period


def _mount(kind: str, option: str | None = None) -> str | None:
    """The mount point of this process's first cgroup mount of `kind` ("cgroup" or "cgroup2") with `option`."""
    return next((point for _root, point, fs, options in host_cpu.mounts()
                 if fs == kind and (option is None or option in options)), None)


def _controller_root() -> tuple[str, str] | tuple[None, str]:
    """("v1" | "v2", the controller's root folder), or (None, why none is usable)."""
    if os.geteuid() != 0:
        return None, "a CPU-limited cgroup needs root"
    v1 = _mount("cgroup", "cpu")
    if v1 and os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")) and os.access(v1, os.W_OK):
        return "v1", v1
    v2 = _mount("cgroup2")
    if v2:
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            enabled = []
        if "cpu" in enabled and os.access(v2, os.W_OK):
            return "v2", v2
        return None, (f"the cgroup2 mount at {v2} has no cpu controller enabled for its children "
                      f"(cgroup.subtree_control: {' '.join(enabled) or 'empty'}) and no v1 cpu controller is mounted")
    return None, "no cpu controller is mounted (neither a cgroup v1 cpu hierarchy nor cgroup2)"


class CpuCgroup:
    """A cgroup with a CPU quota (see the module docstring)."""

    @staticmethod
    def unavailable() -> str | None:
        version, root = _controller_root()
        return None if version else root

    def __init__(self, cores: float):
        if not cores > 0:
            raise ValueError(f"a CPU quota must be above 0 cores, got {cores!r}")
        version, root = _controller_root()
        if version is None:
            raise RuntimeError(f"cannot make a CPU-limited cgroup here: {root}")
        self.version, self.root, self.cores = version, root, cores
        self.path = os.path.join(root, f"hotloop-{os.getpid()}-{next(_counter)}")
        os.mkdir(self.path)
        try:
            quota = int(round(cores * _PERIOD_US))
            if version == "v2":
                self._write("cpu.max", f"{quota} {_PERIOD_US}")
            else:
                self._write("cpu.cfs_period_us", str(_PERIOD_US))
                self._write("cpu.cfs_quota_us", str(quota))
        except BaseException:
            os.rmdir(self.path)
            raise
        self._start = self._raw_stat()

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) into the cgroup."""
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return sorted(members(self.path))

    def _raw_stat(self) -> dict:
        return cpu_stat(self.path)

    def stat(self) -> dict:
        """Periods, throttled periods, throttled seconds and CPU seconds used since the cgroup was made."""
        return stat_delta(self._start, self._raw_stat())

    def close(self) -> None:
        """Move what is left in the cgroup back to the root one and remove it (idempotent)."""
        if not os.path.isdir(self.path):
            return
        _empty_and_remove(self.path, self.root)

    def __enter__(self) -> "CpuCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def remove_stale() -> list[str]:
        """Remove the cgroups of earlier runs whose creating process is gone; returns their paths."""
        version, root = _controller_root()
        removed = []
        if version is None:
            return removed
        for name in os.listdir(root):
            parts = name.split("-")
            if len(parts) == 3 and parts[0] == "hotloop" and parts[1].isdigit() and not os.path.exists(
                    f"/proc/{parts[1]}"):
                _empty_and_remove(os.path.join(root, name), root)
                removed.append(os.path.join(root, name))
        return removed


def cpu_stat(path: str) -> dict:
    """The cgroup at `path`'s counters so far: periods, throttled periods, throttled seconds, CPU seconds used (None
    where the hierarchy does not count them: v1 without cpuacct on the same mount)."""
    with open(os.path.join(path, "cpu.stat")) as f:
        raw = dict(line.split() for line in f if line.strip())
    out = {"periods": int(raw.get("nr_periods", 0)), "throttled_periods": int(raw.get("nr_throttled", 0))}
    if "throttled_usec" in raw:  # v2
        out["throttled_s"] = int(raw["throttled_usec"]) / 1e6
        out["usage_s"] = int(raw.get("usage_usec", 0)) / 1e6
    else:  # v1
        out["throttled_s"] = int(raw.get("throttled_time", 0)) / 1e9
        try:
            with open(os.path.join(path, "cpuacct.usage")) as f:
                out["usage_s"] = int(f.read()) / 1e9
        except OSError:
            out["usage_s"] = None
    return out


def members(path: str) -> set[int]:
    """The processes in the cgroup at `path` now."""
    with open(os.path.join(path, "cgroup.procs")) as f:
        return {int(p) for p in f.read().split()}


def stat_delta(before: dict, after: dict) -> dict:
    return {k: (None if after[k] is None or before[k] is None else after[k] - before[k]) for k in after}


def contained(argv: list[str], path: str | None = None) -> list[str]:
    """`argv` started inside the cgroup at `path` (default: ``$HOTLOOP_CPU_CGROUP``; unset: `argv` as it is): a
    shell moves itself in, then execs it, so the process and all it starts are born in the cgroup."""
    path = path if path is not None else os.environ.get(ENV, "")
    if not path:
        return list(argv)
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(path, "cgroup.procs"), *argv]


def _empty_and_remove(path: str, root: str) -> None:
    # A process moved out is gone from cgroup.procs at once; rmdir can still fail with EBUSY for the moment a
    # dying task takes to leave, so it is retried for up to a second.
    deadline = time.monotonic() + 1.0
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = f.read().split()
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                with open(os.path.join(root, "cgroup.procs"), "w") as f:
                    f.write(pid)
            except (ProcessLookupError, OSError):
                pass  # it exited meanwhile
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
