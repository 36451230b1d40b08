"""Where a process's host CPU goes, by sampling: py-spy on a set of processes at once, each sample of each thread
classified as *waiting* (a busy-wait or a wait primitive: vLLM's SpinCondition / sched_yield / zmq poll, hotloop's
C++ wait, the simulated device's event synchronize) or *work* (everything else).

Contract:

- ``sample(pids, seconds, rate_hz=100)`` blocks for about ``seconds`` (whole seconds, rounded up: py-spy counts
  its samples as seconds x rate) and returns, per name of ``pids`` (name -> pid), a dict: ``samples`` (kept, see
  below), ``waiting``, ``work``, ``waiting_share``, ``waiting_cpu_pct``, ``work_cpu_pct``, ``measured_cpu_pct``
  (every thread's schedstat), ``other_threads_cpu_pct``, ``check``, ``top_waiting`` [(frame, samples, what)],
  ``top_work`` [(frame, samples)], ``intervals``, ``errors``, ``seconds`` (the window), and ``threads`` (tid -> the
  same per thread, with ``name``, ``runnable_pct``, ``measured_runnable_pct``, ``tolerance_pp``).
  ``Sampler(pids, seconds, rate_hz).start()`` ... ``.wait()``
  does the same without blocking the caller in between (a benchmark starts it, runs its load, then waits).
- One ``py-spy record --nonblocking --threads --format raw`` per pid, all at once. ``--nonblocking``: py-spy reads
  the target's memory without stopping it (no ptrace stop per sample; the target runs at full speed) and still gets
  each thread's OS state on Python >= 3.11 (the native thread id is on PyThreadState). ``native=True`` adds C/C++
  frames (py-spy's ``--native``; hotloop's ``_core`` exports its symbols, so ``hotloop::wait_any`` shows), but
  ``--native`` needs py-spy to stop the process for every sample, and then sleeping threads read as running in
  ~25-30 % of samples (measured: a thread in ``time.sleep``), so its CPU shares are too high: use it for the
  frames, not the figures.
- What a sample means: py-spy keeps a thread's sample when ``/proc/<tid>/stat`` says ``R`` (running or runnable,
  read just before the stacks) and its innermost Python frame is not one of py-spy's idle functions
  (``threading.wait``, ``selectors.select``, a zmq/asyncore/gevent/tornado ``poll``); other samples are dropped
  (we do not pass ``--idle``). So a kept sample is a thread that was on a CPU or waiting for one. Per thread,
  ``runnable_pct`` = kept samples / samples taken x 100 (py-spy takes seconds x rate samples, at exponentially
  spaced times, whatever their outcome, less those it could not read); ``waiting_cpu_pct`` = waiting samples /
  samples taken x 100 x the thread's on-CPU fraction of its runnable time from ``/proc/<tid>/schedstat`` (run /
  (run + run-queue wait) over the same window), ``work_cpu_pct`` likewise: percent of one core.
- The check: per thread, ``runnable_pct`` against schedstat's (run + run-queue wait) / wall time over the window
  (from py-spy's "Sampling process" line to its exit; capped at 100 %: schedstat adds a run-queue wait when it
  ends, so one that began before the window counts in it). ``check`` is "ok" when every thread with samples agrees
  within ``tolerance_pp`` (3 binomial standard deviations of the sampled share + 3 points), else it names the
  threads that do not: a thread that is runnable inside one of py-spy's idle frames (a zmq poll returning, a
  condition variable waking) is measured but not kept, and so is one that py-spy could not read (its "Errors").
  py-spy runs at SCHED_FIFO priority 1 where allowed (``_realtime``: at normal priority on a host with more runnable
  threads than cores it samples mostly while its target is off the CPU). Threads py-spy never reports (native
  threads: OpenMP, gloo, ZeroMQ I/O) and idle ones count in the process's ``measured_cpu_pct`` (every thread's
  schedstat) and in ``other_threads_cpu_pct``.
- Classification (``classify``, table ``WAIT_FRAMES`` / ``PASS_FRAMES``): walk the stack from the innermost frame
  outwards, skipping pass-through frames (libc / CPython plumbing, unsymbolized addresses, helpers such as vLLM's
  ``memory_fence``); the first other frame decides: waiting if it matches ``WAIT_FRAMES``, work otherwise. Without
  ``--native`` a C++ wait shows as the Python frame that called it (hotloop's ``MessageQueue.dequeue`` calling
  ``ShmRing.read_object``, as hotloop.vllm's queue does): that frame is a wait, and the C-level unpickling done
  inside the same call counts with it (``native=True`` separates them). A reader's own ``dequeue`` attribute is the
  C++ callable itself, with no Python frame: there only ``native=True`` sees the wait.
- Errors: ``ValueError`` for a pid that is not running or a bad argument; ``SamplingError`` (a RuntimeError) when
  py-spy is missing (says to ``pip install py-spy``) or cannot attach (its message, and what to change), and for a
  target running Python < 3.11 without ``native``: there py-spy's ``--nonblocking`` mode reports Python's thread
  idents, not the OS thread ids whose schedstat gives the CPU (measured on 3.10: every thread "measured 0 %").
- Cost: py-spy's own CPU, per sampled process at 100 Hz, startup included: 0.33 s for a 4 s recording of a
  9-thread process non-blocking (~8 % of a core; 0.45 s blocking, 0.74 s with --native). The sampled process is not
  stopped; on a host with few cores py-spy's CPU competes with it, so sample a repetition of a load, not the run
  whose latency is reported.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from hotloop.bench.proc import alive, schedstat, thread_name


class SamplingError(RuntimeError):
    """py-spy is missing, or could not sample a process."""


# ---- the classification table ----
# (function regex, file or library regex, what it is). A Python frame reads "func (path/file.py:line)", a native
# one "func (lib.so)" or "0xADDR (lib.so)"; py-spy shortens paths to the package ("vllm/.../shm_broadcast.py").
# where hotloop's native frames are: the source file with debug info ("csrc/hotloop/wait_any.cpp:85"), else the
# extension's file name alone ("_core.cpython-311-x86_64-linux-gnu.so", "_core.abi3.so")
_CORE = r"hotloop|^_core\."
WAIT_FRAMES: list[tuple[str, str, str]] = [
    # vLLM's shared-memory queue: the reader's spin on the block's flags (acquire_read, its check()) and its
    # SpinCondition (sched_yield while busy, a zmq poll once idle)
    (r"(^|\.)(acquire_read|check)$", r"vllm/distributed/device_communicators/shm_broadcast\.py",
     "vLLM shm_broadcast spin"),
    (r"(^|\.)SpinCondition\.wait$", r"vllm/distributed/device_communicators/shm_broadcast\.py",
     "vLLM SpinCondition"),
    (r"(^|\.)ReadTimeoutWithWarnings\.(timeout_ms|should_warn)$",
     r"vllm/distributed/device_communicators/shm_broadcast\.py", "vLLM shm_broadcast spin (its timeout check)"),
    (r"^sched_yield$", r"vllm/distributed/utils\.py", "vLLM sched_yield"),
    (r"^(__)?sched_yield$", r"^libc", "sched_yield"),
    (r"", r"vllm/spinloop", "vLLM spinloop extension"),
    # ZeroMQ polls (vLLM's idle SpinCondition, the engine core's input thread, the clients)
    (r"(^|\.)poll$", r"zmq/", "zmq poll"),
    (r"^(zmq_poll|zmq_poller_wait.*|zmq::.*poll.*)$", r"", "zmq poll"),
    # the kernel's waits, native frames (--native)
    (r"^(epoll_wait|__GI_epoll_wait|poll|__poll|__GI___poll|ppoll|select|pselect.*|nanosleep|clock_nanosleep.*|"
     r"__futex_abstimed_wait.*|futex_wait.*|pthread_cond_(timed)?wait.*|sem_(timed)?wait.*)$", r"^(libc|libpthread)",
     "kernel wait"),
    # asyncio's and threading's waits (py-spy drops them as idle when they are off the CPU)
    (r"(^|\.)select$", r"^selectors\.py$", "selectors select"),
    (r"(^|\.)wait$", r"^threading\.py$", "threading wait"),
    # hotloop: the C++ wait (native frames) and the Python frames that call it (without --native)
    (r"^hotloop::(wait_any|futex::wait|.*Doorbell::.*|.*WaitPolicy::.*|ShmRing::wait.*|Waiter::wait.*)", _CORE,
     "hotloop C++ wait"),
    (r"(^|\.)(dequeue|dequeue_bytes)$", r"hotloop/queue/message_queue\.py", "hotloop queue read (C++ wait)"),
    (r"(^|\.)StepPacedWait\.read$", r"hotloop/vllm/step_wait\.py", "hotloop reader's yield-then-park wait"),
    (r"(^|\.)wait_for$", r"hotloop/vllm/engine_loop\.py", "hotloop engine loop wait_any"),
    # the device: the step event's synchronize (the simulated device's clock; CUDA's)
    (r"(^|\.)StreamEvent\.synchronize$", r"hotloop/vllm/sim_device\.py", "simulated device event synchronize"),
    (r"(^|\.)(DeviceClock\.wait|DeviceClock\._wait_launched|_sleep_until|_futex_wait)$",
     r"hotloop/testing/device_clock\.py", "simulated device wait"),
    (r"^(cudaEventSynchronize|cuEventSynchronize|cudaStreamSynchronize|cuStreamSynchronize)$", r"",
     "CUDA synchronize"),
    (r"(^|\.)(Event|Stream)\.synchronize$|^synchronize$", r"torch/cuda/", "torch CUDA synchronize"),
]
# skipped when walking outwards: they neither wait nor work on their own, their caller decides
PASS_FRAMES: list[tuple[str, str]] = [
    (r"^0x[0-9a-fA-F]+$", r""),  # an unsymbolized native frame
    (r"", r"^(libc|libpthread|ld-linux|linux-vdso|\[vdso\])"),  # libc plumbing: syscall(), memcpy, clock_gettime
    (r"^(_?Py|cfunction_|method_vectorcall|vectorcall|_PyEval|slot_tp|object_vacall|call_function|builtin_)",
     r"python|libpython"),  # CPython's call machinery around a C function
    (r"(^|\.)memory_fence$", r"vllm/distributed/device_communicators/shm_broadcast\.py"),
    (r"^hotloop::(ShmRing::read.*|.*::ready|ShmRing::ReaderSource.*)$", _CORE),  # a read's helpers
]
NO_FRAME = "(no Python frame)"  # a kept sample with an empty stack (py-spy read it mid-update): counted as work
_WAIT = [(re.compile(f), re.compile(p), what) for f, p, what in WAIT_FRAMES]
_PASS = [(re.compile(f), re.compile(p)) for f, p in PASS_FRAMES]
_FRAME = re.compile(r"^(?P<func>.*) \((?P<where>[^()]*)\)$")


def split_frame(frame: str) -> tuple[str, str, bool]:
    """(function, file or library, is Python) of one py-spy frame ("func (file.py:12)", "func (lib.so)")."""
    m = _FRAME.match(frame)
    if not m:
        return frame, "", False
    where = m["where"]
    file, sep, line = where.rpartition(":")
    if sep and line.isdigit():
        return m["func"], file, True
    return m["func"], where, False


def classify(stack: tuple[str, ...] | list[str]) -> tuple[str, str]:
    """("waiting" | "work", the deciding frame) of one stack, outermost frame first (py-spy's raw order)."""
    for frame in reversed(stack):
        func, where, _py = split_frame(frame)
        for f, p, _what in _WAIT:
            if f.search(func) and p.search(where):
                return "waiting", frame
        if any(f.search(func) and p.search(where) for f, p in _PASS):
            continue
        return "work", frame
    return "work", stack[-1] if stack else NO_FRAME


def wait_kind(frame: str) -> str:
    """What a waiting frame is (WAIT_FRAMES' third column), "" for a frame that is not a wait."""
    func, where, _py = split_frame(frame)
    return next((what for f, p, what in _WAIT if f.search(func) and p.search(where)), "")


# ---- py-spy's raw output ----

_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9A-Fa-f]+|\d+)\)(: (?P<name>.*))?$")


def parse_raw(text: str) -> dict[tuple[int, str], collections.Counter]:
    """py-spy's ``record --threads --format raw`` output: (tid, thread name) -> Counter of stacks (tuples of frames,
    outermost first, the thread frame removed)."""
    out: dict[tuple[int, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not py-spy raw output (no sample count at the end): {line[:200]!r}")
        frames = stack_text.split(";")
        m = _THREAD.match(frames[0])
        if m:
            tid = int(m["tid"], 16) if m["tid"].startswith("0x") else int(m["tid"])
            key, frames = (tid, m["name"] or ""), frames[1:]
        else:
            key = (0, "")  # recorded without --threads
        out[key][tuple(frames)] += int(count)
    return dict(out)


# ---- /proc ----

def python_version_of(pid: int) -> tuple[int, int] | None:
    """The target's Python (major, minor) from its executable's or its libpython's name, where one says it."""
    names = []
    try:
        names.append(os.path.basename(os.readlink(f"/proc/{pid}/exe")))
        with open(f"/proc/{pid}/maps") as f:
            names += [line.rsplit("/", 1)[-1] for line in f if "libpython" in line]
    except OSError:
        return None
    for name in names:
        m = re.match(r"(?:lib)?python(\d+)\.(\d+)", name)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def _realtime() -> None:
    """In py-spy's process before it starts: SCHED_FIFO priority 1 where allowed (root, CAP_SYS_NICE), so it samples
    when its timer fires rather than when the loaded CPUs let it run: on a host with more runnable threads than
    cores, a sampler at normal priority runs mostly while its target is off the CPU, and reads it idle too often
    (measured: a vLLM engine core read runnable 49 % of the time against schedstat's 89 %). Elsewhere it runs at
    normal priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        pass


def py_spy_path() -> str:
    """The py-spy executable: on PATH, or next to this interpreter (a virtual environment's bin/)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not found:
        raise SamplingError("py-spy not found: pip install py-spy (0.4 or later; it is in hotloop's 'test' extra), "
                            "or put it on PATH")
    return found


# ---- sampling ----

@dataclasses.dataclass
class _Run:
    name: str
    pid: int
    proc: subprocess.Popen
    out_path: str
    log: list[str] = dataclasses.field(default_factory=list)
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    t0: float = 0.0
    t1: float = 0.0
    s0: dict = dataclasses.field(default_factory=dict)
    s1: dict = dataclasses.field(default_factory=dict)
    reader: threading.Thread | None = None


class Sampler:
    """py-spy on every process of `pids` (name -> pid) for `seconds` (rounded up to whole seconds) at `rate_hz`:
    ``start()``, then ``wait()`` for the figures (see the module docstring)."""

    def __init__(self, pids: dict[str, int], seconds: float, rate_hz: int = 100, native: bool = False,
                 top: int = 5):
        if not pids:
            raise ValueError("no processes to sample: pass name -> pid")
        if not 1 <= rate_hz <= 1000:
            raise ValueError(f"rate_hz must be 1-1000, got {rate_hz}")
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        for name, pid in pids.items():
            if not isinstance(pid, int) or pid <= 0 or not alive(pid):
                raise ValueError(f"process {name!r} (pid {pid}) is not running: pass the pid of a live process")
        self.pids, self.rate_hz, self.native, self.top = dict(pids), int(rate_hz), native, top
        self.seconds = max(1, math.ceil(seconds))
        self.intervals = self.seconds * self.rate_hz  # the samples py-spy takes of each process
        self._runs: list[_Run] = []
        self._tmp: str | None = None

    def start(self) -> "Sampler":
        """Start py-spy on every process; returns once each has attached (raises SamplingError if one cannot)."""
        for name, pid in self.pids.items():  # refused before py-spy is looked for: the answer is the same either way
            version = python_version_of(pid)
            if not self.native and version is not None and version < (3, 11):
                raise SamplingError(f"process {name!r} (pid {pid}) runs Python {version[0]}.{version[1]}: py-spy's "
                                    "--nonblocking mode gets a thread's OS id (which its CPU is read by) only from "
                                    "Python 3.11 on; sample a Python >= 3.11 process, or pass native=True (frames "
                                    "only: its CPU figures are too high)")
        exe = py_spy_path()
        self._tmp = tempfile.mkdtemp(prefix="hotloop-samples-")
        for name, pid in self.pids.items():
            self._runs.append(self._launch(exe, name, pid))
        deadline = time.monotonic() + 60
        for i, run in enumerate(self._runs):
            for attempts_left in reversed(range(3 if self.native else 1)):
                run.started.wait(max(0.0, deadline - time.monotonic()))
                if run.t0 or not attempts_left or not alive(run.pid) or time.monotonic() >= deadline:
                    break
                # --native stops the target and unwinds every thread; py-spy gives up at attach when a thread's
                # native stack does not line up with its Python frames at that instant ("Failed to merge native
                # and python frames", seen under load): a later attach gets another instant
                self._close(run)
                run = self._runs[i] = self._launch(exe, run.name, run.pid)
            if not run.t0:
                self._abort()
                raise SamplingError(self._why(run))
        return self

    def _launch(self, exe: str, name: str, pid: int) -> _Run:
        out = os.path.join(self._tmp, f"{pid}.txt")
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--duration", str(self.seconds),
               "--format", "raw", "--output", out, "--threads"] + (["--native"] if self.native else
                                                                   ["--nonblocking"])
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", preexec_fn=_realtime)
        run = _Run(name, pid, proc, out)
        run.reader = threading.Thread(target=self._follow, args=(run,), name=f"py-spy {pid}", daemon=True)
        run.reader.start()
        return run

    def _follow(self, run: _Run) -> None:
        """Reads one py-spy's output: snapshots the process's threads when sampling starts and when it ends."""
        for line in run.proc.stdout:
            run.log.append(line.rstrip())
            if not run.t0 and "Sampling process" in line:
                run.s0, run.t0 = schedstat(run.pid), time.monotonic()
                run.started.set()
        run.proc.wait()
        run.s1, run.t1 = schedstat(run.pid), time.monotonic()
        run.started.set()

    def _why(self, run: _Run) -> str:
        errors = [line for line in run.log if line.startswith("Error")]  # py-spy's cause, above its backtrace
        text = "\n".join(errors[-1:] + run.log[-8:]).strip() or f"py-spy exited with code {run.proc.poll()}"
        hint = ""
        if "ermission" in text or "ptrace" in text.lower():
            hint = (" (py-spy needs ptrace on the target: run as the same user with kernel.yama.ptrace_scope 0, or "
                    "as root; in a container, add CAP_SYS_PTRACE)")
        elif not alive(run.pid):
            hint = " (the process is gone)"
        return f"py-spy could not sample process {run.name!r} (pid {run.pid}){hint}: {text}"

    def _abort(self) -> None:
        for run in self._runs:
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGINT)
        for run in self._runs:
            self._close(run)
        self._cleanup()

    @staticmethod
    def _close(run: _Run) -> None:
        """Ends one py-spy (already signalled, or exited) and closes its pipe once its reader has drained it."""
        try:
            run.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()
        run.reader.join(10)
        if not run.reader.is_alive():
            run.proc.stdout.close()

    def _cleanup(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def wait(self) -> dict[str, dict]:
        """Wait for every py-spy to finish; name -> figures (the module docstring says what they are)."""
        if not self._runs:
            raise RuntimeError("Sampler.wait() before start()")
        try:
            for run in self._runs:
                run.reader.join(self.seconds * 4 + 60)
                if run.reader.is_alive():
                    raise SamplingError(f"py-spy on {run.name!r} (pid {run.pid}) did not finish within "
                                        f"{self.seconds * 4 + 60} s of a {self.seconds} s recording")
            return {run.name: self._result(run) for run in self._runs}
        finally:
            self._abort()

    def _result(self, run: _Run) -> dict:
        try:
            with open(run.out_path) as f:
                stacks = parse_raw(f.read())
        except FileNotFoundError:
            raise SamplingError(self._why(run)) from None
        summary = next((line for line in run.log if "Samples:" in line), "")
        m = re.search(r"Errors: (\d+)", summary)
        errors = int(m[1]) if m else 0
        ended_early = any("process exited" in line for line in run.log)
        return _figures(run.pid, stacks, max(1, self.intervals - errors), errors, run.t1 - run.t0, run.s0, run.s1,
                        self.rate_hz, self.top, ended_early)


def sample(pids: dict[str, int], seconds: float, rate_hz: int = 100, native: bool = False, top: int = 5) -> dict:
    """Sample every process of `pids` (name -> pid) for `seconds`; name -> figures. See the module docstring."""
    return Sampler(pids, seconds, rate_hz, native, top).start().wait()


# ---- figures ----

def _tolerance_pp(share: float, n: int) -> float:
    """How far a sampled share (percent) may be from the measured one: 3 binomial standard deviations + 3 points
    (py-spy reads a thread's state a moment before its stack; its window starts and ends a few ms off ours)."""
    p = min(max(share / 100.0, 0.0), 1.0)
    return 300.0 * math.sqrt(max(p * (1 - p), 0.25 / n) / n) + 3.0


def _figures(pid, stacks, intervals, errors, wall_s, s0, s1, rate_hz, top, ended_early) -> dict:
    threads = {}
    waits_top: collections.Counter = collections.Counter()
    work_top: collections.Counter = collections.Counter()
    for (tid, tname), counter in sorted(stacks.items()):
        waiting = work = 0
        for stack, n in counter.items():
            kind, frame = classify(stack)
            if kind == "waiting":
                waiting += n
                waits_top[frame] += n
            else:
                work += n
                work_top[frame] += n
        kept = waiting + work
        run0, rq0 = s0.get(tid, (0, 0))
        run1, rq1 = s1.get(tid, (run0, rq0))
        run_ns, rq_ns = max(0, run1 - run0), max(0, rq1 - rq0)
        on_cpu = run_ns / (run_ns + rq_ns) if run_ns + rq_ns else 1.0
        runnable = 100.0 * kept / intervals
        # capped at 100: schedstat adds a run-queue wait when it ends, so one that began before the window counts in it
        measured_runnable = min(100.0, 100.0 * (run_ns + rq_ns) / 1e9 / wall_s) if wall_s > 0 else math.nan
        threads[tid] = {
            "name": tname or thread_name(pid, tid), "samples": kept, "waiting": waiting, "work": work,
            "waiting_share": waiting / kept if kept else math.nan,
            "runnable_pct": runnable, "waiting_cpu_pct": 100.0 * waiting / intervals * on_cpu,
            "work_cpu_pct": 100.0 * work / intervals * on_cpu,
            "measured_cpu_pct": 100.0 * run_ns / 1e9 / wall_s if wall_s > 0 else math.nan,
            "measured_runnable_pct": measured_runnable, "tolerance_pp": _tolerance_pp(runnable, intervals),
        }
    total_run = sum(max(0, s1.get(t, v)[0] - v[0]) for t, v in s0.items())
    sampled_run = sum(max(0, s1.get(t, v)[0] - v[0]) for t, v in s0.items() if t in threads)
    bad = [f"{t} {th['name']}: sampled {th['runnable_pct']:.1f} %, measured {th['measured_runnable_pct']:.1f} % "
           f"(tolerance {th['tolerance_pp']:.1f})" for t, th in threads.items()
           if not abs(th["runnable_pct"] - th["measured_runnable_pct"]) <= th["tolerance_pp"]]
    kept = sum(th["samples"] for th in threads.values())
    waiting = sum(th["waiting"] for th in threads.values())
    return {
        "pid": pid, "seconds": wall_s, "rate_hz": rate_hz, "intervals": intervals, "errors": errors,
        "samples": kept, "waiting": waiting, "work": kept - waiting,
        "waiting_share": waiting / kept if kept else math.nan,
        "waiting_cpu_pct": sum(th["waiting_cpu_pct"] for th in threads.values()),
        "work_cpu_pct": sum(th["work_cpu_pct"] for th in threads.values()),
        "measured_cpu_pct": 100.0 * total_run / 1e9 / wall_s if wall_s > 0 else math.nan,
        "other_threads_cpu_pct": 100.0 * (total_run - sampled_run) / 1e9 / wall_s if wall_s > 0 else math.nan,
        "check": "ok" if not bad and not ended_early else
                 ("process exited while sampled" if ended_early else "differs: " + "; ".join(bad)),
        "threads": threads,
        "top_waiting": [(f, n, wait_kind(f)) for f, n in waits_top.most_common(top)],
        "top_work": work_top.most_common(top),
    }


# ---- the CLI ----

def render(results: dict[str, dict]) -> str:
    """A table of `sample`'s figures: per process, then its threads with samples."""
    head = (f"{'process / thread':34} {'samples':>7} {'waiting':>7} {'share':>6} {'wait CPU%':>9} {'work CPU%':>9} "
            f"{'proc CPU%':>9}  check")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name + ' (' + str(r['pid']) + ')':34} {r['samples']:7d} {r['waiting']:7d} "
                     f"{_pct(r['waiting_share'])} {r['waiting_cpu_pct']:9.1f} {r['work_cpu_pct']:9.1f} "
                     f"{r['measured_cpu_pct']:9.1f}  {r['check']}")
        for tid, th in sorted(r["threads"].items(), key=lambda kv: -kv[1]["samples"]):
            if th["samples"]:
                lines.append(f"  {(th['name'] or '?')[:22] + ' ' + str(tid):32} {th['samples']:7d} "
                             f"{th['waiting']:7d} {_pct(th['waiting_share'])} {th['waiting_cpu_pct']:9.1f} "
                             f"{th['work_cpu_pct']:9.1f} {th['measured_cpu_pct']:9.1f}")
        for f, n, what in r["top_waiting"]:
            lines.append(f"    waiting {n:6d}  {what}: {f}")
        for f, n in r["top_work"]:
            lines.append(f"    work    {n:6d}  {f}")
    lines.append(f"Method: py-spy record --nonblocking at {next(iter(results.values()))['rate_hz']} Hz per process; a "
                 "sample is kept when the thread is runnable (/proc state R) and not in one of py-spy's idle frames; "
                 "CPU % = kept share x the thread's on-CPU fraction of its runnable time (schedstat); proc CPU% = "
                 "every thread's schedstat; check = sampled runnable share vs schedstat's, per thread.")
    return "\n".join(lines)


def _pct(share: float) -> str:
    return f"{'-':>6}" if math.isnan(share) else f"{100 * share:5.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.host_samples",
                                 description="Where processes' host CPU goes: py-spy samples, waiting or work.")
    ap.add_argument("--pid", action="append", required=True, metavar="NAME=PID", help="a process to sample (repeat)")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long (whole seconds, rounded up; default 5)")
    ap.add_argument("--rate", type=int, default=100, help="samples a second per process (default 100)")
    ap.add_argument("--native", action="store_true", help="with C/C++ frames (stops the process per sample: the CPU "
                    "shares read too high; see the module docstring)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    pids = {}
    for item in args.pid:
        name, sep, pid = item.rpartition("=")
        if not sep or not name or not pid.isdigit():
            ap.error(f"--pid takes NAME=PID, got {item!r}")
        pids[name] = int(pid)
    try:
        results = sample(pids, args.seconds, args.rate, args.native)
    except (ValueError, SamplingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(results))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
