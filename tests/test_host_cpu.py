"""hotloop.host_cpu: a container's CPU quota read from its cgroup (v1 and v2, fake trees), the rule that counts it
as the host's cores (hotloop.vllm.step_wait.choose), and the same read inside a real CPU-limited cgroup."""

import os
import subprocess
import sys
import time

import pytest

from hotloop import host_cpu
from hotloop.testing.cpu_cgroup import CpuCgroup, contained

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def tree(tmp_path, cgroup: str, mountinfo: str, files: dict[str, str]) -> str:
    """A fake root: /proc/self/cgroup, /proc/self/mountinfo and the cgroup files given (path -> content)."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for path, content in files.items():
        f = tmp_path / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(content + "\n")
    return str(tmp_path)


def test_v2_quota_is_cpu_max_over_its_period(tmp_path):
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", V2_MOUNTS,
                {"/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "150000 100000"})
    assert host_cpu.cpu_quota(root) == 1.5


def test_v2_max_is_no_limit(tmp_path):
    root = tree(tmp_path, "0::/user.slice\n", V2_MOUNTS, {"/sys/fs/cgroup/user.slice/cpu.max": "max 100000"})
    assert host_cpu.cpu_quota(root) is None


def test_v2_the_smallest_quota_on_the_path_wins(tmp_path):
    """A pod's limit sits on the pod's cgroup, its containers' below: the pod's 1 core binds a 4-core container."""
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", V2_MOUNTS,
                {"/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "400000 100000",
                 "/sys/fs/cgroup/kubepods/pod1/cpu.max": "50000 50000",
                 "/sys/fs/cgroup/kubepods/cpu.max": "max 100000"})
    assert host_cpu.cpu_quota(root) == 1.0


def test_v2_inside_a_cgroup_namespace(tmp_path):
    """In a container the cgroup path is "/" and the mount's own cpu.max is the container's."""
    root = tree(tmp_path, "0::/\n", V2_MOUNTS, {"/sys/fs/cgroup/cpu.max": "250000 100000"})
    assert host_cpu.cpu_quota(root) == 2.5


def test_v1_quota_is_cfs_quota_over_period(tmp_path):
    root = tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n", V1_MOUNTS,
                {"/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000",
                 "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
                 "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                 "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert host_cpu.cpu_quota(root) == 1.0


def test_v1_minus_one_is_no_limit(tmp_path):
    root = tree(tmp_path, "3:cpu,cpuacct:/\n0::/\n", V1_MOUNTS,
                {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                 "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert host_cpu.cpu_quota(root) is None


def test_v1_mount_rooted_at_the_containers_cgroup(tmp_path):
    """A container's v1 mount whose root is its own cgroup: /proc/self/cgroup has the host's path, the files are
    at the mount point."""
    mounts = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
    root = tree(tmp_path, "3:cpu,cpuacct:/docker/abc\n", mounts,
                {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "50000",
                 "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert host_cpu.cpu_quota(root) == 0.5


def test_no_cgroup_files_is_no_limit_and_never_raises(tmp_path):
    assert host_cpu.cpu_quota(str(tmp_path)) is None  # no /proc at all
    root = tree(tmp_path, "0::/gone\n", V2_MOUNTS, {"/sys/fs/cgroup/cpu.max": "garbage"})
    assert host_cpu.cpu_quota(root) is None


def test_usable_cores_is_the_quota_where_it_is_below_the_affinity(tmp_path):
    cores = len(os.sched_getaffinity(0))
    below = tree(tmp_path / "below", "0::/\n", V2_MOUNTS, {"/sys/fs/cgroup/cpu.max": f"{cores * 50000} 100000"})
    assert host_cpu.usable_cores(below) == cores / 2
    above = tree(tmp_path / "above", "0::/\n", V2_MOUNTS, {"/sys/fs/cgroup/cpu.max": f"{cores * 300000} 100000"})
    assert host_cpu.usable_cores(above) == cores
    assert host_cpu.usable_cores(str(tmp_path / "none")) == cores
    # a quota already read is taken as it is, the files not read again
    assert host_cpu.usable_cores(str(tmp_path / "none"), quota=cores / 4) == cores / 4
    assert host_cpu.usable_cores(below, quota=None) == cores


def test_the_rule_counts_a_quota_as_the_hosts_cores(monkeypatch):
    """step_wait.choose with a quota below the affinity: the front end counts beside the engine core and the
    workers, and a quota they outnumber gets the plain wait (no spin window spending the pod's quota); a quota
    above the affinity changes nothing."""
    from hotloop.vllm import step_wait

    monkeypatch.delenv("HOTLOOP_VLLM_YIELD_US", raising=False)
    monkeypatch.delenv("HOTLOOP_VLLM_PACED", raising=False)
    choose = step_wait.choose
    # (workers, affinity, quota) -> kind
    table = {(1, 64, 1.0): "plain", (1, 64, 1.5): "plain", (1, 64, 2.5): "plain", (1, 64, 3.0): "paced",
             (2, 64, 4.0): "paced", (4, 64, 4.0): "plain", (1, 2, 4.0): "yield", (2, 2, 4.0): "plain",
             (1, 2, None): "yield", (1, 3, None): "paced"}
    for (workers, affinity, quota), kind in table.items():
        cores = min(affinity, quota) if quota is not None else affinity
        wait = choose(workers, on_host=False, cores=cores, quota=quota)
        assert wait.kind == kind, ((workers, affinity, quota), wait)
        if quota is not None and quota < affinity:
            assert f"quota of {quota:g}" in wait.why, wait.why
    monkeypatch.setenv("HOTLOOP_VLLM_PACED", "1")  # every switch still overrides the rule
    assert choose(1, on_host=False, cores=1.0, quota=1.0).kind == "paced"


CHILD = "from hotloop import host_cpu; from hotloop.vllm import step_wait; " \
        "print(host_cpu.cpu_quota(), step_wait.HOST_QUOTA, step_wait.HOST_CORES)"


def test_a_process_in_a_cpu_limited_cgroup_reads_its_quota():
    """A real cgroup (v1 or v2, whichever this host has writable) with 1.5 cores: a process started inside it reads
    1.5, and the rule's HOST_CORES counts it; the cgroup is gone after."""
    why = CpuCgroup.unavailable()
    if why:
        pytest.skip(why)
    with CpuCgroup(1.5) as group:
        # born in the cgroup (contained: a shell moves itself in, then execs Python), as the bench's servers are
        out = subprocess.run(contained([sys.executable, "-c", CHILD], group.path), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        quota, host_quota, host_cores = out.stdout.split()
        assert float(quota) == 1.5 and float(host_quota) == 1.5
        assert float(host_cores) == min(1.5, len(os.sched_getaffinity(0)))
        assert group.stat()["periods"] >= 0
    assert not os.path.exists(group.path)


def test_a_cpu_cgroup_throttles_a_spinner_and_is_removed_with_a_process_still_in_it():
    """CpuCgroup(0.2): a spinning child is throttled (cpu.stat), and leaving the block by an exception while the
    child still runs moves it back to the root cgroup and removes the cgroup."""
    why = CpuCgroup.unavailable()
    if why:
        pytest.skip(why)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with CpuCgroup(0.2) as group:
                group.add(child.pid)
                assert group.pids() == [child.pid]
                deadline = time.monotonic() + 30
                while group.stat()["throttled_periods"] < 3:  # a 100 ms period each: ~0.4 s of spinning
                    assert time.monotonic() < deadline, group.stat()
                    time.sleep(0.05)
                stat = group.stat()
                assert stat["throttled_s"] > 0 and stat["periods"] >= stat["throttled_periods"]
                raise RuntimeError("a failure inside the block")
        assert not os.path.exists(group.path)
        assert child.poll() is None  # moved out, not killed
    finally:
        child.kill()
        child.wait()
