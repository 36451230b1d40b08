"""Shared fixtures: every test must leave no threads, file descriptors, child processes or /dev/shm segments
behind (``no_leaks``); ``children()`` and ``own_segments()`` for tests that check them themselves."""

import importlib.util
import os
import signal
import struct
import threading
import time

import pytest

# multiprocessing's resource tracker (started by the first spawned process and kept for the whole session) holds
# a pipe; start it now so it is not counted as a leak of whichever test spawns first.
from multiprocessing import resource_tracker  # noqa: E402

resource_tracker.ensure_running()

# Ctrl-C as a terminal gives it, whatever started the suite: a shell's background job (`cmd &` without job control,
# nohup) starts with SIGINT ignored, a disposition its children inherit through exec, and a Python started that way
# installs no KeyboardInterrupt handler, so the tests that send SIGINT to a waiting child would see it ignored. A
# handler set here is reset to the default in every child at exec, where Python installs its own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes many seconds (pytest -m \"not slow\" for a quick run)")
    config.addinivalue_line("markers", "quiet: a timing check in milliseconds that needs a core free beside it "
                            "(scripts/test_pythons.sh runs these one at a time, after the suites it runs side by side)")


# Under an emulator: scripts/test_aarch64.sh runs the torch-free suite in an aarch64 Python under qemu-user with
# HOTLOOP_EMULATED=qemu-aarch64. These tests check what the emulator does not reproduce, so they skip there, each
# with why; everywhere else (HOTLOOP_EMULATED unset) all of them run. Keyed by file and test function (all of its
# parameters), or file and test id (one parameter set).
EMULATED = os.environ.get("HOTLOOP_EMULATED", "")
_CPU_TIME = ("asleep, not spinning, is checked as the thread's CPU time, which under qemu-user includes the "
             "emulator translating the code the thread runs")
_NO_FUTEX_WAITV = ("checks a park backend better than 'sliced', which needs futex_waitv or io_uring; qemu-user "
                   "implements neither")
NOT_UNDER_EMULATION = {
    "test_wait_any.py::test_park_backend_is_reported_and_selectable": _NO_FUTEX_WAITV,
    "test_wait_any.py::test_park_backend_follows_the_environment[fallback-futex_waitv helper]": _NO_FUTEX_WAITV,
    "test_device_clock.py::test_a_step_lasts_its_modelled_time_off_the_cpu": _CPU_TIME,
    "test_device_clock.py::test_tp_ranks_end_each_step_together_at_the_last_start_plus_the_step_time": _CPU_TIME,
    "test_metrics.py::test_waiter_stats_count_each_wait_once_in_the_phase_it_ended":
        "the park phase is checked to last the whole 10 ms timeout, which holds where the work before the park "
        "takes less than the timer's slack; emulated, it takes ~0.3 ms",
    "test_message_queue_remote.py::test_a_remote_reader_that_does_not_read_makes_enqueue_time_out":
        "expects ZeroMQ's buffers to take two 1 MiB messages, each enqueued with a 0.2 s timeout, before the reader "
        "is found behind; emulated on a loaded machine the second missed its 0.2 s (1 run in 4)",
    "test_host_samples.py::test_an_older_python_is_refused_with_what_to_do":
        "reads /proc/PID/exe of a child right after subprocess.Popen returns, which under qemu-user can be before "
        "the child's exec took effect (the link still names the emulator in most tries)",
}


def pytest_collection_modifyitems(config, items):
    if not EMULATED:
        return
    modules = {}
    for item in items:
        modules[item.path.name] = getattr(item, "module", None)
        why = (NOT_UNDER_EMULATION.get(f"{item.path.name}::{item.name}")
               or NOT_UNDER_EMULATION.get(f"{item.path.name}::{getattr(item, 'originalname', item.name)}"))
        if why:
            item.add_marker(pytest.mark.skip(reason=f"under {EMULATED}: {why}"))
    # an entry whose test is gone (renamed, removed) is an error wherever its file was collected
    stale = []
    for key in NOT_UNDER_EMULATION:
        file, test = key.split("::")
        if file in modules and not hasattr(modules[file], test.split("[")[0]):
            stale.append(key)
    if stale:
        raise pytest.UsageError(f"conftest.NOT_UNDER_EMULATION names tests that are not there: {stale}")


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


def _process_table() -> dict[int, int]:
    """pid -> parent pid of every process visible here."""
    table = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    table[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return table


def children() -> set[int]:
    """This process's live child processes (multiprocessing's resource tracker apart: one per session)."""
    me = os.getpid()
    out = set()
    for pid, parent in _process_table().items():
        if parent == me:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"resource_tracker" not in f.read():
                        out.add(pid)
            except OSError:
                pass
    return out


def hotloop_segments() -> set[str]:
    """The names of hotloop's /dev/shm segments (every process's): queue rings ("hotloop-<pid namespace>-<pid>-...")
    and node relay rings ("hotloop-node-<pid namespace>-<digest>")."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("hotloop-")}


_LAYOUT_MAGIC = 0x51504F4F4C544F48  # "HOTLOOPQ": shm_ring.cpp's kMagic
_LAYOUT_WRITER_PID = struct.Struct("<QIIQQIi")  # magic .. writer_pid of shm_ring.cpp's Layout


def segment_creator(name: str) -> tuple[int, int] | None:
    """(pid namespace, pid) of the process that made segment `name` (a /dev/shm file name), or None when the
    segment does not say. A queue ring's name carries both ("hotloop-<ns>-<pid>-<start>-<n>-<random>"); a node
    relay ring's name carries only the namespace ("hotloop-node-<ns>-<digest>", hotloop/queue/relay.py: every
    reader of the node derives it), so its writer's pid is read from the ring's header, as the reaper does."""
    parts = name.split("-")
    if parts[0] != "hotloop" or len(parts) < 3:
        return None
    if parts[1] == "node":
        if not parts[2].isdigit():
            return None
        try:
            with open(f"/dev/shm/{name}", "rb") as f:
                head = f.read(_LAYOUT_WRITER_PID.size)
        except OSError:
            return None
        if len(head) < _LAYOUT_WRITER_PID.size:
            return None  # being created: its header is not written yet
        magic, *_, writer_pid = _LAYOUT_WRITER_PID.unpack(head)
        return (int(parts[2]), writer_pid) if magic == _LAYOUT_MAGIC and writer_pid > 0 else None
    if not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return int(parts[1]), int(parts[2])


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def own_segments() -> set[str]:
    """hotloop's /dev/shm segments made by this process or its descendants (segment_creator says whose). One whose
    creator is alive and not ours (another test run on the machine), or made in another PID namespace, is not
    counted; one whose creator is gone is (a child of this test that died leaving it)."""
    table = _process_table()
    mine = {os.getpid()}
    grew = True
    while grew:
        more = {pid for pid, parent in table.items() if parent in mine} - mine
        mine |= more
        grew = bool(more)
    own_ns = _pid_namespace()
    out = set()
    for name in hotloop_segments():
        creator = segment_creator(name)
        if creator is None or creator[0] != own_ns:
            continue
        if creator[1] in mine or creator[1] not in table:
            out.add(name)
    return out


def _settles(check, seconds: float):
    """check() until it returns something falsy or `seconds` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while True:
        left = check()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition") -> None:
    """Wait for an observable state (a parked count, a sleeping thread, a flag) instead of sleeping a fixed time
    and hoping: checks `predicate` every millisecond; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.001)


def _task_state(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def thread_sleeping(thread: threading.Thread) -> bool:
    """Whether `thread` (of this process) is asleep in the kernel now (a futex, ppoll or io_uring park: state S)."""
    return _task_state(f"/proc/self/task/{thread.native_id}/stat") == "S"


def process_sleeping(pid: int) -> bool:
    """Whether process `pid`'s main thread is asleep in the kernel now (state S)."""
    return _task_state(f"/proc/{pid}/stat") == "S"


_SYS_FUTEX = 202  # x86-64


def thread_parked_in_segment(thread: threading.Thread, segment: str) -> bool:
    """Whether `thread` (of this process) sleeps now in a futex wait on a word inside /dev/shm segment `segment`
    (a ring's doorbell): a park on that ring, told apart from a wait for the GIL or a lock, which sleep on this
    process's private memory. x86-64 only (the futex system call's number); False elsewhere."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) != _SYS_FUTEX:
        return False
    word = int(fields[1], 16)
    path = "/dev/shm/" + segment.lstrip("/")
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)  # span, perms, offset, device, inode, path
            if len(parts) == 6 and parts[5].strip().removesuffix(" (deleted)") == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= word < hi:
                    return True
    return False


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test leaves no threads, file descriptors, child processes or /dev/shm segments behind."""
    threads_before = set(threading.enumerate())
    fds_before = _open_fds()
    kids_before = children()
    segments_before = own_segments()
    yield
    extra_threads = _settles(lambda: [t for t in threading.enumerate() if t not in threads_before and t.is_alive()],
                             2.0)
    assert not extra_threads, f"test left threads running: {extra_threads}"
    extra_fds = _settles(lambda: _open_fds() - fds_before, 2.0)
    # an fd listed before may have been closed; only new ones count as leaks
    leaked = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in extra_fds if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked, f"test left file descriptors open: {leaked}"
    new_kids = _settles(lambda: children() - kids_before, 5.0)
    assert not new_kids, f"test left child processes: {new_kids}"
    # a segment whose creator died before unlinking it (a killed process, a fuzzer's child) is the reaper's by
    # design: reap those first, so what remains is what a live process of this run left behind
    from hotloop import _core

    _core.reap_stale_segments()
    new_segments = _settles(lambda: own_segments() - segments_before, 5.0)
    assert not new_segments, f"test left /dev/shm segments: {new_segments}"


# CUDA: the process opens one driver, once. Unless HOTLOOP_TEST_CUDA=real (the GPU check script sets it), the
# suite runs against the fake driver shipped in hotloop.testing, selected here before any test can open one.
CUDA_BACKEND = os.environ.get("HOTLOOP_TEST_CUDA", "fake")
if CUDA_BACKEND == "fake":
    from hotloop.testing import FAKE_CUDA_LIBRARY

    os.environ["HOTLOOP_CUDA_DRIVER"] = FAKE_CUDA_LIBRARY


def require_supported_vllm() -> None:
    """Skip the calling test module unless vLLM imports here and is a version hotloop.vllm supports (the vLLM
    engine tests run vLLM in child processes; ``pip install "hotloop[vllm]"``, docs/vllm.md)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a vLLM build that fails to import here)
        pytest.skip(f"vLLM is not importable ({type(e).__name__}: {e}); pip install \"hotloop[vllm]\" to run these",
                    allow_module_level=True)
    from hotloop.vllm import SUPPORTED_VLLM_VERSIONS, is_supported, vllm_version

    if not is_supported(vllm_version()):
        pytest.skip(f"vLLM {vllm_version()} is not one hotloop supports ({SUPPORTED_VLLM_VERSIONS})",
                    allow_module_level=True)


def require_torch():
    """torch, for a test or test module that needs it. Where torch is not installed (scripts/test_pythons.sh runs
    the suite on other Pythons without it) the caller is skipped with the reason, unless HOTLOOP_TEST_REQUIRE_TORCH=1
    (scripts/test.sh), where that fails. A torch that is installed but does not import fails, never skips."""
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("HOTLOOP_TEST_REQUIRE_TORCH") == "1":
            pytest.fail("torch is not installed, and HOTLOOP_TEST_REQUIRE_TORCH=1 says it must be (pip install "
                        "torch==2.13.0)", pytrace=False)
        pytest.skip("needs torch, which is not installed (pip install torch==2.13.0; scripts/test_pythons.sh runs "
                    "the torch-free tests on other Pythons)", allow_module_level=True)
    import torch

    return torch


@pytest.fixture
def response_queue():
    """A vLLM step's response queue on hotloop's ring (hotloop.vllm.MessageQueue): (the worker's writer, the engine
    core's reader), attached."""
    from hotloop.vllm.message_queue import MessageQueue

    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(10)
    yield writer, reader
    reader.close()
    writer.close()
