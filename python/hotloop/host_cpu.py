"""host_cpu: how much CPU this process may use: the cores of its affinity and its cgroup's CPU quota.

Contract:

- ``cpu_quota()``: the CFS quota of the process's cgroup in cores (quota / period: 150000 / 100000 -> 1.5), the
  smallest along the cgroup's path up to its mount's root (a pod's limit sits on the pod's cgroup, the container's
  below it), or None where there is none. Both hierarchies are read: v2 (``cpu.max``: ``"max 100000"`` is no limit)
  and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under the cpu controller's mount; ``-1`` is no limit); on a
  hybrid host the smaller of both. A file that is missing or unreadable counts as no limit: this never raises on a
  host without cgroups.
- ``usable_cores()``: ``len(os.sched_getaffinity(0))`` or the quota where it is smaller (a Kubernetes
  ``resources.limits.cpu`` of 1.5 on a 64-core node: 1.5). A quota is spent by every thread of the cgroup's
  processes together; once spent, all of them stop until the next period. A waiter that spins spends it for
  nothing, so hotloop's waits count the quota as the host's cores (``hotloop.vllm.step_wait``). ``quota=`` takes
  a quota already read instead of reading it again.
- ``root``: a prefix put before every path read (``/proc/self/...``, the mount points): tests lay out a fake
  ``/proc`` and ``/sys`` under a temporary folder. ``proc``: the process's ``/proc`` entry (default ``self``).
- Cost: a few small file reads; callers read it once per process.
"""

from __future__ import annotations

import os

__all__ = ["cpu_quota", "usable_cores"]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def mounts(root: str = "", proc: str = "self") -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of every cgroup mount the process sees."""
    out = []
    for line in (_read(f"{root}/proc/{proc}/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((fields[3], fields[4], after[0], set(after[2].split(","))))
    return out


def _dirs_up(mount_point: str, mount_root: str, cgroup_path: str) -> list[str]:
    """The cgroup's folder under its mount and each ancestor's, up to the mount's folder (innermost first)."""
    if mount_root != "/" and (cgroup_path == mount_root or cgroup_path.startswith(mount_root + "/")):
        cgroup_path = cgroup_path[len(mount_root):]  # a container's mount whose root is its own cgroup
    parts = [p for p in cgroup_path.split("/") if p]
    return [os.path.join(mount_point, *parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(folder: str) -> float | None:
    raw = _read(f"{folder}/cpu.max")
    if raw is None:
        return None
    quota, _, period = raw.partition(" ")
    if quota == "max":
        return None
    try:
        q, p = int(quota), int(period or 100000)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _v1_quota(folder: str) -> float | None:
    quota, period = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cpu_quota(root: str = "", proc: str = "self") -> float | None:
    """The smallest CFS quota (in cores) on the process's cgroup path, v1 and v2; None where there is none."""
    quotas = []
    found = mounts(root, proc)
    for line in (_read(f"{root}/proc/{proc}/cgroup") or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # v2: the unified hierarchy
            wanted = [(r, m) for r, m, kind, _ in found if kind == "cgroup2"]
            read = _v2_quota
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            wanted = [(r, m) for r, m, kind, opts in found if kind == "cgroup" and "cpu" in opts]
            read = _v1_quota
        else:
            continue
        for mount_root, mount_point in wanted:
            for folder in _dirs_up(root + mount_point, mount_root, path):
                q = read(folder)
                if q is not None:
                    quotas.append(q)
    return min(quotas) if quotas else None


_READ = object()


def usable_cores(root: str = "", proc: str = "self", *, quota=_READ) -> float:
    """The affinity's cores, or the cgroup's CPU quota where it is smaller (`quota`: one cpu_quota() already
    returned, so a caller that keeps both reads the files once)."""
    cores = float(len(os.sched_getaffinity(0)))
    if quota is _READ:
        quota = cpu_quota(root, proc)
    return min(cores, quota) if quota is not None else cores
