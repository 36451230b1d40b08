"""hotloop.bench.host_samples: the classification table on canned py-spy output, and py-spy on child processes that
busy-spin as vLLM's SpinCondition does (waiting, a core), wait in hotloop's queue with no message (~0 CPU) or
compute (work), with the sampled CPU checked against the threads' schedstat."""

import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import process_sleeping, wait_until

from hotloop.bench import host_samples
from hotloop.bench.host_samples import SamplingError, classify, parse_raw, split_frame

SECONDS = 2

# ---- the table, on canned py-spy output (no py-spy needed) ----

SHM = "vllm/distributed/device_communicators/shm_broadcast.py"
CANNED = f"""\
thread (101): MainThread;<module> (worker.py:1);WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);MessageQueue.dequeue ({SHM}:900);MessageQueue.acquire_read ({SHM}:850) 40
thread (101): MainThread;<module> (worker.py:1);WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);MessageQueue.dequeue ({SHM}:900);MessageQueue.acquire_read ({SHM}:860);SpinCondition.wait ({SHM}:208);sched_yield (vllm/distributed/utils.py:46) 50
thread (101): MainThread;<module> (worker.py:1);WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);MessageQueue.dequeue ({SHM}:900);MessageQueue.acquire_read ({SHM}:840);MessageQueue.acquire_read.<locals>.check ({SHM}:836);memory_fence ({SHM}:99) 5
thread (101): MainThread;<module> (worker.py:1);WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);MessageQueue.dequeue ({SHM}:905) 3
thread (101): MainThread;<module> (worker.py:1);WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);WorkerProc._execute_worker_rpc (vllm/v1/executor/multiproc_executor.py:1060);CPUModelRunner.execute_model (vllm/v1/worker/cpu_model_runner.py:200) 2
thread (102): WorkerAsyncOutputCopy;Thread._bootstrap (threading.py:1002);AsyncCPUModelRunnerOutput.get_output (vllm/v1/worker/gpu_model_runner.py:300);StreamEvent.synchronize (hotloop/vllm/sim_device.py:131);DeviceClock.wait (hotloop/testing/device_clock.py:200);_sleep_until (hotloop/testing/device_clock.py:60) 7
thread (103): Thread-1;Thread._bootstrap (threading.py:1002);EngineCoreProc.process_input_sockets (vllm/v1/engine/core.py:1300);Poller.poll (zmq/sugar/poll.py:106) 4
thread (201): MainThread;<module> (w.py:1);StepPacedWait.read (hotloop/vllm/step_wait.py:199);MessageQueue.dequeue (hotloop/queue/message_queue.py:402) 6
thread (201): MainThread;<module> (w.py:1);MessageQueue.dequeue (hotloop/queue/message_queue.py:402);_rebuild (vllm/v1/outputs.py:12) 1
thread (202): MainThread;0x7f00 (libc.so.6);<module> (w.py:1);MessageQueue.dequeue (hotloop/queue/message_queue.py:402);0x7f01 (hotloop/_core.cpython-311-x86_64-linux-gnu.so);hotloop::ShmRing::read (hotloop/_core.cpython-311-x86_64-linux-gnu.so);hotloop::ShmRing::wait_readable (hotloop/_core.cpython-311-x86_64-linux-gnu.so);hotloop::wait_any (hotloop/_core.cpython-311-x86_64-linux-gnu.so);hotloop::ShmRing::ReaderSource::ready (hotloop/_core.cpython-311-x86_64-linux-gnu.so) 8
thread (202): MainThread;<module> (w.py:1);MessageQueue.dequeue (hotloop/queue/message_queue.py:402);hotloop::ShmRing::read (hotloop/_core.cpython-311-x86_64-linux-gnu.so);load (_pickle.cpython-311-x86_64-linux-gnu.so) 2
thread (203): MainThread;<module> (w.py:1);SpinCondition.wait ({SHM}:208);0x7f02 (python3.11);sched_yield (libc.so.6) 9
"""


def test_parse_raw_keeps_threads_and_counts():
    stacks = parse_raw(CANNED)
    assert set(stacks) == {(101, "MainThread"), (102, "WorkerAsyncOutputCopy"), (103, "Thread-1"),
                           (201, "MainThread"), (202, "MainThread"), (203, "MainThread")}
    assert sum(stacks[(101, "MainThread")].values()) == 100
    # the thread frame is removed; frames stay outermost first
    assert all(not s[0].startswith("thread (") for c in stacks.values() for s in c)
    assert next(iter(stacks[(102, "WorkerAsyncOutputCopy")])) [-1] == "_sleep_until (hotloop/testing/device_clock.py:60)"


def test_parse_raw_refuses_other_text():
    with pytest.raises(ValueError, match="not py-spy raw output"):
        parse_raw("py-spy> Sampling process 100 times a second\n")


@pytest.mark.parametrize("frame,want", [
    ("MessageQueue.acquire_read (vllm/distributed/device_communicators/shm_broadcast.py:850)",
     ("MessageQueue.acquire_read", "vllm/distributed/device_communicators/shm_broadcast.py", True)),
    ("hotloop::wait_any (hotloop/_core.cpython-311-x86_64-linux-gnu.so)",
     ("hotloop::wait_any", "hotloop/_core.cpython-311-x86_64-linux-gnu.so", False)),
    ("0x7f12b6e4524a (libc.so.6)", ("0x7f12b6e4524a", "libc.so.6", False)),
    ("<module> (spin.py:6)", ("<module>", "spin.py", True)),
])
def test_split_frame(frame, want):
    assert split_frame(frame) == want


def _by_thread(tid):
    return [(stack, n, classify(stack)) for stack, n in parse_raw(CANNED)[next(k for k in parse_raw(CANNED)
                                                                               if k[0] == tid)].items()]


def test_vllm_busy_wait_is_waiting_and_its_work_is_not():
    got = {stack[-1].split(" (")[0]: kind for stack, _n, (kind, _f) in _by_thread(101)}
    assert got == {"MessageQueue.acquire_read": "waiting", "sched_yield": "waiting",
                   "memory_fence": "waiting",  # passes through to check(), the spin's flag test
                   "MessageQueue.dequeue": "work",  # vLLM's dequeue itself unpickles: work
                   "CPUModelRunner.execute_model": "work"}
    deciding = dict((stack[-1], frame) for stack, _n, (_k, frame) in _by_thread(101))
    assert any("check" in f for f in deciding.values())


def test_event_synchronize_zmq_poll_and_hotloop_reads_are_waiting():
    assert [kind for _s, _n, (kind, _f) in _by_thread(102)] == ["waiting"]
    assert [kind for _s, _n, (kind, _f) in _by_thread(103)] == ["waiting"]
    # hotloop's dequeue calls C++ (the wait); a Python loader it calls is work
    kinds = {stack[-1].split(" (")[0]: kind for stack, _n, (kind, _f) in _by_thread(201)}
    assert kinds == {"MessageQueue.dequeue": "waiting", "_rebuild": "work"}


def test_native_frames_tell_the_cpp_wait_from_unpickling():
    kinds = {stack[-1].split(" (")[0]: (kind, frame.split(" (")[0]) for stack, _n, (kind, frame) in _by_thread(202)}
    assert kinds["hotloop::ShmRing::ReaderSource::ready"] == ("waiting", "hotloop::wait_any")
    assert kinds["load"] == ("work", "load")
    # libc's sched_yield under CPython's call machinery, in vLLM's SpinCondition
    assert [kind for _s, _n, (kind, _f) in _by_thread(203)] == ["waiting"]


def test_unknown_work_is_work():
    assert classify(("<module> (x.py:1)", "crunch (x.py:4)")) == ("work", "crunch (x.py:4)")
    assert classify(("<module> (x.py:1)", "0x7f00 (libc.so.6)")) == ("work", "<module> (x.py:1)")


# ---- py-spy on child processes ----

def _py_spy_attaches() -> str:
    """"" when py-spy can sample a child of this process here, else why not."""
    try:
        exe = host_samples.py_spy_path()
    except SamplingError as e:
        return str(e)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_until(lambda: process_sleeping(child.pid), 10, "the child's sleep")
        p = subprocess.run([exe, "dump", "--pid", str(child.pid), "--nonblocking"], capture_output=True, text=True,
                           timeout=60)
        return "" if p.returncode == 0 else f"py-spy cannot attach here: {(p.stdout + p.stderr).strip()[-300:]}"
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def py_spy():
    if sys.version_info < (3, 11):  # the children run this Python
        pytest.skip("py-spy's --nonblocking mode gets OS thread ids only from Python 3.11 on (host_samples refuses "
                    "older targets: test_an_older_python_is_refused_with_what_to_do)")
    why = _py_spy_attaches()
    if why:
        pytest.skip(why)


# vLLM's reader busy-wait in vLLM's own file layout (a package vllm/distributed/... so py-spy names the frames as it
# does vLLM's): acquire_read tests the flag, SpinCondition.wait yields while reads are recent
FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/utils.py": "import os\n\ndef sched_yield():\n    os.sched_yield()\n",
    "vllm/distributed/device_communicators/__init__.py": "",
    "vllm/distributed/device_communicators/shm_broadcast.py": textwrap.dedent("""\
        import time
        from vllm.distributed.utils import sched_yield

        class SpinCondition:
            def __init__(self):
                self.last_read = time.monotonic()

            def wait(self):
                if time.monotonic() <= self.last_read + 3600:
                    sched_yield()

        class MessageQueue:
            def __init__(self):
                self.flag = bytearray(1)
                self.cond = SpinCondition()

            def acquire_read(self):
                while not self.flag[0]:
                    self.cond.wait()

        print("ready", flush=True)
        MessageQueue().acquire_read()
        """),
}

# A reader of hotloop's queue with nothing to read. "vllm": hotloop.vllm's MessageQueue (vLLM's surface, its readers'
# default wait: spin, yield, park); "spin": the queue's own reader with a policy that only spins, called as
# hotloop.vllm calls it (the class's dequeue, the C++ read under it).
HOTLOOP_READER = """\
import sys
from hotloop import MessageQueue, WaitPolicy
if sys.argv[1] == "vllm":
    from hotloop.vllm.message_queue import MessageQueue as VllmQueue
    q = VllmQueue(1, 1, max_chunk_bytes=1 << 14)
    r = VllmQueue.create_from_handle(q.export_handle(), 0)
    read = r.dequeue
else:
    q = MessageQueue(1, max_chunk_bytes=1 << 14)
    r = MessageQueue.create_from_handle(q.export_handle(), 0, policy=WaitPolicy(spin_us=1e9, yield_us=0))
    read = lambda timeout: MessageQueue.dequeue(r, timeout)
q.wait_until_ready()
print("ready", flush=True)
while True:
    try:
        read(timeout=3600)
    except TimeoutError:
        pass
"""

ARITHMETIC = """\
print("ready", flush=True)
x = 0
for i in range(10 ** 12):
    x = (x * 31 + i) % 1000003
"""


@pytest.fixture
def child(tmp_path):
    procs = []

    def start(code: str, *args, files: dict | None = None, module: str | None = None) -> int:
        for rel, text in (files or {}).items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", module] if module else [sys.executable, "-c", code, *args]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()


def _main_thread(res: dict) -> dict:
    return res["threads"].get(res["pid"]) or {"samples": 0, "waiting": 0, "work": 0, "waiting_cpu_pct": 0.0,
                                               "work_cpu_pct": 0.0, "runnable_pct": 0.0}


def test_python_busy_wait_like_vllm_is_waiting_at_a_core(py_spy, child):
    pid = child("", files=FAKE_VLLM, module="vllm.distributed.device_communicators.shm_broadcast")
    res = host_samples.sample({"spin": pid}, SECONDS)["spin"]
    main = _main_thread(res)
    assert res["check"] == "ok", res["check"]
    assert main["runnable_pct"] >= 85, main  # on a CPU or waiting for one nearly all the time
    assert main["waiting"] >= 0.95 * main["samples"], res["top_work"]
    assert res["waiting_share"] >= 0.95
    # its CPU (what schedstat measured) is all waiting
    assert main["waiting_cpu_pct"] >= 0.9 * main["measured_cpu_pct"] > 0
    assert any(what in ("vLLM SpinCondition", "vLLM sched_yield", "vLLM shm_broadcast spin")
               for _f, _n, what in res["top_waiting"])


def test_hotloop_reader_with_no_message_costs_no_cpu(py_spy, child):
    pid = child(HOTLOOP_READER, "vllm")
    wait_until(lambda: process_sleeping(pid), 10, "the reader's park")
    res = host_samples.sample({"reader": pid}, SECONDS)["reader"]
    assert res["check"] == "ok", res["check"]
    # the exact figure (schedstat) is under 1 % of a core; the sampled ones are 200 samples, each 0.5 %, and a
    # sample can catch the parked reader runnable in a wake-up of its park (CI once saw 2)
    assert res["measured_cpu_pct"] < 1.0, res
    assert res["waiting_cpu_pct"] <= 2.0 and res["work_cpu_pct"] <= 2.0, res


def test_hotloop_cpp_spin_counts_as_waiting(py_spy, child):
    pid = child(HOTLOOP_READER, "spin")  # spins in C++, GIL released
    res = host_samples.sample({"reader": pid}, SECONDS)["reader"]
    main = _main_thread(res)
    assert res["check"] == "ok", res["check"]
    assert main["runnable_pct"] >= 85, main
    assert main["waiting"] >= 0.95 * main["samples"], res["top_work"]
    assert res["top_waiting"][0][2] == "hotloop queue read (C++ wait)"


def test_arithmetic_is_work(py_spy, child):
    pid = child(ARITHMETIC)
    res = host_samples.sample({"work": pid}, SECONDS)["work"]
    main = _main_thread(res)
    assert res["check"] == "ok", res["check"]
    assert main["runnable_pct"] >= 85, main
    assert main["work"] >= 0.98 * main["samples"] and main["waiting"] <= 0.02 * main["samples"]
    assert main["work_cpu_pct"] >= 0.9 * main["measured_cpu_pct"] > 0


def test_several_processes_at_once(py_spy, child):
    spin = child("", files=FAKE_VLLM, module="vllm.distributed.device_communicators.shm_broadcast")
    work = child(ARITHMETIC)
    res = host_samples.sample({"spin": spin, "work": work}, SECONDS)
    assert res["spin"]["waiting_share"] >= 0.95 and res["work"]["waiting_share"] <= 0.02
    assert res["spin"]["pid"] == spin and res["work"]["pid"] == work


def test_native_frames_name_hotloop_wait(py_spy, child):
    pid = child(HOTLOOP_READER, "spin")
    res = host_samples.sample({"reader": pid}, 1, native=True)["reader"]
    assert res["waiting"] >= 0.9 * res["samples"] > 0, res["top_work"]
    assert any("hotloop::" in f for f, _n, _what in res["top_waiting"]), res["top_waiting"]


MERGE_ERROR = "Error: Failed to merge native and python frames (Have 1 native and 2 python)"


def _flaky_py_spy(tmp_path, monkeypatch, failures: int) -> None:
    """py-spy that fails to attach as py-spy 0.4 does under load (its cause, then a backtrace) `failures` times,
    then runs the real one."""
    real, count = host_samples.py_spy_path(), tmp_path / "attaches"
    fake = tmp_path / "py-spy"
    fake.write_text(f"""#!/bin/sh
echo x >> {count}
if [ "$(wc -l < {count})" -le {failures} ]; then
  echo "{MERGE_ERROR}"; echo "Stack backtrace:"; echo "   0: anyhow::error::from"; exit 1
fi
exec {real} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setattr(host_samples, "py_spy_path", lambda: str(fake))


def test_a_native_attach_that_fails_is_tried_again(py_spy, child, tmp_path, monkeypatch):
    pid = child(HOTLOOP_READER, "spin")
    _flaky_py_spy(tmp_path, monkeypatch, failures=2)
    res = host_samples.sample({"reader": pid}, 1, native=True)["reader"]
    assert res["samples"] > 0
    assert (tmp_path / "attaches").read_text().count("x") == 3


def test_a_native_attach_that_keeps_failing_says_why(py_spy, child, tmp_path, monkeypatch):
    pid = child(HOTLOOP_READER, "spin")
    _flaky_py_spy(tmp_path, monkeypatch, failures=3)
    why = rf"could not sample process 'reader' \(pid {pid}\): {re.escape(MERGE_ERROR)}"
    with pytest.raises(SamplingError, match=why):
        host_samples.sample({"reader": pid}, 1, native=True)
    # the autouse no_leaks fixture checks that no py-spy's pipe is left open


# ---- bad input ----

def test_a_gone_pid_is_refused():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(ValueError, match=rf"process 'gone' \(pid {p.pid}\) is not running"):
        host_samples.sample({"gone": p.pid}, 1)


@pytest.mark.parametrize("kw,match", [({"seconds": 0}, "seconds must be > 0"), ({"rate_hz": 0}, "rate_hz must be"),
                                      ({"pids": {}}, "no processes")])
def test_bad_arguments(kw, match):
    args = {"pids": {"me": os.getpid()}, "seconds": 1, **kw}
    with pytest.raises(ValueError, match=match):
        host_samples.Sampler(**args)


def test_an_older_python_is_refused_with_what_to_do():
    assert host_samples.python_version_of(os.getpid()) in (None, sys.version_info[:2])
    old = sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10"))
    if not old:
        pytest.skip("no Python 3.10 here (pyenv install 3.10)")
    p = subprocess.Popen([old[-1], "-c", "import time; time.sleep(60)"])
    try:
        assert host_samples.python_version_of(p.pid) == (3, 10)
        with pytest.raises(SamplingError, match=r"runs Python 3\.10: .*only from Python 3\.11 on"):
            host_samples.sample({"old": p.pid}, 1)
    finally:
        p.kill()
        p.wait()


def test_missing_py_spy_says_what_to_install(monkeypatch):
    monkeypatch.setattr(host_samples.shutil, "which", lambda *_a, **_k: None)
    with pytest.raises(SamplingError, match="pip install py-spy"):
        host_samples.sample({"me": os.getpid()}, 1, native=True)  # native: no Python version refused first


def test_cli_rejects_a_bad_pid_argument(capsys):
    with pytest.raises(SystemExit):
        host_samples.main(["--pid", "nopid"])
    assert "NAME=PID" in capsys.readouterr().err
