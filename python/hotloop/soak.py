"""``hotloop soak``: the whole stack under load for N minutes while processes are killed, stopped and fed garbage.

Contract:

- Load, all on loopback (127.0.0.1) and all at once:
  - ``QueueGroup``: a writer process with shared-memory readers and remote (TCP) readers of one MessageQueue
    (``n_local_reader < n_reader``). Each message is ``(writer id, generation, sequence, crc32, payload)``, its
    size random (up to several times the ring). Readers block in ``dequeue`` and check every message: none lost,
    none duplicated, in order, checksum good. A kill ends the queue's *generation*; the group then recreates
    the queue and its processes, so traffic continues for the whole run.
  - ``EngineLoad``: an ``AsyncEngineClient`` engine (executor "multiproc", model "tiny") serving a stream of
    requests, some of them bad (NaN or tiny temperatures, out-of-vocabulary ids, wrong types, ...). A bad request
    may be rejected by the client (ValueError / TypeError, "at the edge") or by the engine (RequestError); both
    are clear errors. Restarted when it dies.
  - ``OrchestratorLoad``: an Orchestrator with two LLM replicas feeding a transform replica, the same request mix;
    a dead replica is replaced (``add_replica``).
- ``Chaos`` (seeded): at random moments SIGKILLs a random process (queue writer or reader, engine, engine worker,
  replica), or SIGSTOPs it for 0.1-2 s and SIGCONTs it, or connects raw TCP / ZeroMQ sockets to a queue's
  publisher port and sends garbage (which must not disturb the readers).
- ``Report``: after the run (and a grace period that bounds every outcome), a table on stdout; progress on
  stderr; ``--json`` writes the record. Rows marked ``must be 0``: messages lost, duplicated, out of order or
  corrupt on surviving readers; unexpected queue errors; requests hung (no terminal outcome within HANG_S of
  their previous output) or failed without a kill to explain it; engine deaths and replica evictions no kill
  explains; leaked /dev/shm/hotloop-* entries, child processes and file descriptors of this process. The time
  from each kill to the survivors' error (writer: DeadPeerError for a dead reader; readers: DeadPeerError for a
  dead writer; the client: EngineDeadError; the orchestrator: the request's ReplicaDeadError) is reported as
  p50 / p99 / max against a goal (1 s by default). The exit code is 1 when a ``must be 0`` row is not 0 or the
  goal is missed (``--no-fail-on-goal`` reports the goal without failing on it), else 0.
- Not covered: raw frames to an engine's input socket (its address is not part of the public API), the blocking
  ``EngineClient``, tensor parallelism > 1, other nodes (everything is loopback), the poll orchestrator loop.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field

CTX = mp.get_context("spawn")  # this process runs threads and ZeroMQ contexts: never fork it
LOOPBACK = "127.0.0.1"
HANG_S = 30.0  # an outcome not reached within this long after the previous sign of life is a hang
START_TIMEOUT_S = 120.0
MUST_BE_ZERO = "must be 0"


def _log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the soak) dies, so an interrupted soak leaves nothing running."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/pid/stat): tells a live pid from a reused one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _ours(pid: int) -> bool:
    """Whether `pid` is this process or one of its descendants (walks the parent chain in /proc)."""
    me, seen = os.getpid(), set()
    while pid > 1 and pid not in seen:
        if pid == me:
            return True
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def send_signal(pid: int, sig: int) -> bool:
    """Signal `pid` only if it is still one of the soak's own processes: a pidfd pins the process first, then its
    parent chain is checked, so a pid reused by another program (after ours died) is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not _ours(pid):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def children_of(pid: int) -> set[int]:
    """Direct children of `pid`, without multiprocessing's resource tracker."""
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    if b"resource_tracker" in f.read():
                        continue
            except OSError:
                continue
            out.add(k)
    return out


def descendants_of(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for k in children_of(todo.pop()):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _creator_pid(segment: str) -> int | None:
    """hotloop-<namespace>-<creator pid>-...: the process that created a /dev/shm segment."""
    try:
        return int(segment.split("-")[2])
    except (IndexError, ValueError):
        return None


def shm_entries() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("hotloop-")}


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    s = sorted(xs)

    def rank(p):
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"n": len(s), "p50": rank(0.50), "p99": rank(0.99), "max": s[-1]}


# ---------------------------------------------------------------------------------------------------------------
# kills and their detection


@dataclass
class Kill:
    """One chaos SIGKILL and when (monotonic clock, shared by every process on the machine) survivors noticed."""

    kind: str  # "queue writer", "queue local reader", "queue remote reader", "engine", "engine worker", "replica"
    label: str
    pid: int
    t: float
    detected_s: list[float] = field(default_factory=list)  # one per survivor that raised its error
    note: str = ""


@dataclass
class Target:
    kind: str
    label: str
    pid: int = 0
    kill: object = None  # callable(): SIGKILL it (and record the Kill); None: not killable
    address: str | None = None  # a queue publisher's tcp://ip:port: garbage goes there


# ---------------------------------------------------------------------------------------------------------------
# queue traffic (child process mains: module level, so spawn can import them)


def _payload_size(rng: random.Random, ring: int) -> int:
    r = rng.random()
    if r < 0.70:
        return rng.randrange(0, 512)
    if r < 0.95:
        return rng.randrange(512, 16 << 10)
    if r < 0.99:
        return rng.randrange(16 << 10, ring)
    return rng.randrange(ring, 3 * ring)  # larger than the whole ring: split into chunks


def _writer_main(wid: int, gen: int, n_reader: int, n_local: int, max_chunk: int, rate: float, seed: int, ctrl,
                 counter_path: str) -> None:
    """One generation's writer: sends until told to stop (or a reader dies), then shuts the queue down and
    reports. After each enqueue that returned, the count of sent messages is in `counter_path` (it survives a
    SIGKILL of this process)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from hotloop import ClosedError, DeadPeerError, MessageQueue

    fd = os.open(counter_path, os.O_RDWR)
    counter = mmap.mmap(fd, 8)
    os.close(fd)
    q = MessageQueue(n_reader, n_local_reader=n_local, max_chunk_bytes=max_chunk, connect_ip=LOOPBACK,
                     bind_ip=LOOPBACK)
    ctrl.send(("handle", q.export_handle()))
    try:
        q.wait_until_ready(START_TIMEOUT_S)
    except Exception as e:
        ctrl.send(("done", {"end": "start_failed", "t": time.monotonic(), "error": repr(e), "sent": 0}))
        return
    ctrl.send(("ready", time.monotonic()))
    ring = max(4096, 4 * (max_chunk + 64))
    rng = random.Random(f"{seed}-{wid}-{gen}")
    seq, end, error, t_end = 0, "stopped", "", 0.0
    while not ctrl.poll():
        payload = rng.randbytes(_payload_size(rng, ring))
        try:
            q.enqueue((wid, gen, seq, zlib.crc32(payload), payload), timeout=HANG_S)
        except DeadPeerError as e:
            end, error, t_end = "dead_peer", str(e), time.monotonic()
            break
        except TimeoutError as e:
            end, error, t_end = "timeout", str(e), time.monotonic()
            break
        except (ClosedError, Exception) as e:
            end, error, t_end = "error", repr(e), time.monotonic()
            break
        seq += 1
        struct.pack_into("q", counter, 0, seq)
        time.sleep(rng.expovariate(rate))  # the load's pacing (not a wait for data)
    try:
        q.shutdown()
    except Exception as e:
        error += f"; shutdown failed: {e!r}"
    ctrl.send(("done", {"end": end, "t": t_end, "error": error, "sent": seq}))
    q.close()


def _reader_main(handle, rank: int, wid: int, gen: int, conn) -> None:
    """One reader: blocks in dequeue, checks every message, reports when the queue ends (closed / dead writer)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from hotloop import ClosedError, DeadPeerError, MessageQueue

    q = MessageQueue.create_from_handle(handle, rank)
    seen: set[int] = set()
    max_seq, dup, ooo, bad, foreign = -1, 0, 0, 0, 0
    while True:
        try:
            msg = q.dequeue()
        except ClosedError:
            end, error = "closed", ""
            break
        except DeadPeerError as e:
            end, error = "dead_peer", str(e)
            break
        except Exception as e:
            end, error = "error", repr(e)
            break
        try:
            w, g, seq, crc, payload = msg
        except (TypeError, ValueError):
            bad += 1
            continue
        if (w, g) != (wid, gen):
            foreign += 1
            continue
        if zlib.crc32(payload) != crc:
            bad += 1
        if seq in seen:
            dup += 1
            continue
        if seq < max_seq:
            ooo += 1
        seen.add(seq)
        max_seq = max(max_seq, seq)
    t_end = time.monotonic()
    conn.send({"rank": rank, "end": end, "t": t_end, "error": error, "received": len(seen), "max_seq": max_seq,
               "gaps": max_seq + 1 - len(seen), "dup": dup, "ooo": ooo, "bad": bad, "foreign": foreign})
    q.close()


@dataclass
class ReaderTotals:
    sent: int = 0
    received: int = 0
    lost: int = 0
    dup: int = 0
    ooo: int = 0
    bad: int = 0
    inflight_at_writer_kill: int = 0  # remote tail a killed writer never sent (documented: ZeroMQ sends later)
    generations: int = 0


class QueueGroup:
    """One writer and its readers, recreated as a new generation whenever chaos kills one of them."""

    def __init__(self, wid: int, n_reader: int, n_local: int, report: "Report", seed: int, workdir: str,
                 max_chunk: int = 16 << 10, rate: float = 100.0):
        self.wid, self.n_reader, self.n_local = wid, n_reader, n_local
        self.max_chunk, self.rate, self.seed = max_chunk, rate, seed
        self.report = report
        self.counter_path = os.path.join(workdir, f"writer-{wid}.count")
        with open(self.counter_path, "wb") as f:
            f.write(b"\0" * 8)
        self.gen = 0
        self.pids: set[int] = set()
        self.totals = {r: ReaderTotals() for r in range(n_reader)}
        self.generations = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._live = None  # (gen, writer, readers, ctrl, address) while traffic flows and no kill hit it yet
        self._kill: Kill | None = None
        self._killed_role: tuple[str, int] | None = None
        self._ctrl = None
        self._thread = threading.Thread(target=self._run, name=f"soak-queue-{wid}", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        with self._lock:
            self._stopping = True
            self._live = None
            if self._ctrl is not None:
                try:
                    self._ctrl.send("stop")
                except OSError:
                    pass

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return self.generations > 0 or self._live is not None

    def rank_kind(self, rank: int) -> str:
        return "queue local reader" if rank < self.n_local else "queue remote reader"

    def targets(self) -> list[Target]:
        with self._lock:
            if self._live is None:
                return []
            gen, writer, readers, _, address = self._live
        out = [Target("queue writer", f"q{self.wid}.g{gen} writer", writer.pid,
                      lambda: self._do_kill(gen, ("writer", -1), writer.pid))]
        for rank, p in enumerate(readers):
            out.append(Target(self.rank_kind(rank), f"q{self.wid}.g{gen} reader r{rank}", p.pid,
                              lambda rank=rank, p=p: self._do_kill(gen, ("reader", rank), p.pid)))
        if address:
            out.append(Target("queue port", f"q{self.wid}.g{gen} publisher {address}", address=address))
        return out

    def _do_kill(self, gen: int, role: tuple[str, int], pid: int) -> Kill | None:
        with self._lock:
            if self._live is None or self._live[0] != gen:
                return None
            self._live = None  # one kill per generation: its survivors' errors are then unambiguous
            send_signal(pid, signal.SIGKILL)
            kind = "queue writer" if role[0] == "writer" else self.rank_kind(role[1])
            self._kill = Kill(kind, f"q{self.wid}.g{gen} {role[0]}{'' if role[1] < 0 else f' r{role[1]}'}", pid,
                              time.monotonic())
            self._killed_role = role
            return self._kill

    def _run(self):
        while True:
            with self._lock:
                if self._stopping:
                    return
            try:
                self._generation()
            except Exception as e:  # the soak's own bug: report it, do not spin
                self.report.finding("queue", f"q{self.wid}: the group's controller failed: {e!r}", zero=True)
                return

    def _generation(self):
        self.gen += 1
        gen = self.gen
        with open(self.counter_path, "r+b") as f:
            f.write(b"\0" * 8)
        ctrl, child = CTX.Pipe()
        writer = CTX.Process(target=_writer_main, name=f"soak-q{self.wid}-writer", daemon=True,
                             args=(self.wid, gen, self.n_reader, self.n_local, self.max_chunk, self.rate, self.seed,
                                   child, self.counter_path))
        writer.start()
        self.pids.add(writer.pid)
        child.close()
        readers, conns = [], []
        self._kill, self._killed_role = None, None
        try:
            msg = self._recv(ctrl, writer, START_TIMEOUT_S)
            if not msg or msg[0] != "handle":
                raise RuntimeError(f"no handle from the writer ({msg!r}, exit code {writer.exitcode})")
            handle = msg[1]
            for rank in range(self.n_reader):
                parent, c = CTX.Pipe(duplex=False)
                p = CTX.Process(target=_reader_main, name=f"soak-q{self.wid}-r{rank}", daemon=True,
                                args=(handle, rank, self.wid, gen, c))
                p.start()
                self.pids.add(p.pid)
                c.close()
                readers.append(p)
                conns.append(parent)
            msg = self._recv(ctrl, writer, START_TIMEOUT_S)
            if not msg or msg[0] != "ready":
                raise RuntimeError(f"the writer did not report ready ({msg!r}, exit code {writer.exitcode})")
        except Exception as e:
            self.report.finding("queue", f"q{self.wid}.g{gen}: generation failed to start: {e}", zero=True)
            self.report.count("queue start failures")
            for p in [writer, *readers]:
                p.kill()
                p.join()
            for c in [ctrl, *conns]:
                c.close()
            return
        with self._lock:
            self._ctrl = ctrl
            if self._stopping:
                try:
                    ctrl.send("stop")
                except OSError:
                    pass
            else:
                self._live = (gen, writer, readers, ctrl, handle.remote_address)
        procs = [writer, *readers]
        mpc.wait([p.sentinel for p in procs])  # a kill, or the writer's end after "stop"
        deadline = time.monotonic() + HANG_S
        hung = self._wait_all(procs, deadline)
        with self._lock:
            self._live = None
            self._ctrl = None
            kill, role = self._kill, self._killed_role
        for p in hung:
            p.kill()
            p.join()
        w_report = None
        while ctrl.poll():  # the handle and ready messages were read; what is left is the final report
            try:
                m = ctrl.recv()
            except (EOFError, OSError):
                break
            if m[0] == "done":
                w_report = m[1]
        r_reports = {}
        for rank, c in enumerate(conns):
            try:
                if c.poll():
                    r_reports[rank] = c.recv()
            except (EOFError, OSError):
                pass
        for c in [ctrl, *conns]:
            c.close()
        with open(self.counter_path, "rb") as f:
            sent = struct.unpack("q", f.read(8))[0]
        self._account(gen, kill, role, writer, readers, hung, w_report, r_reports, sent)

    @staticmethod
    def _recv(conn, proc, timeout):
        ready = mpc.wait([conn, proc.sentinel], timeout)
        if conn in ready:
            try:
                return conn.recv()
            except EOFError:
                return None
        return None

    @staticmethod
    def _wait_all(procs, deadline) -> list:
        alive = [p for p in procs if p.exitcode is None]
        while alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            mpc.wait([p.sentinel for p in alive], left)
            alive = [p for p in alive if p.exitcode is None]
        for p in procs:
            if p not in alive:
                p.join()
        return alive

    def _account(self, gen, kill, role, writer, readers, hung, w_report, r_reports, sent):
        tag = f"q{self.wid}.g{gen}"
        rep = self.report
        self.generations += 1
        self.sent += sent
        if hung:
            rep.count("queue processes hung", len(hung))
            rep.finding("queue", f"{tag}: {[p.name for p in hung]} had no outcome within {HANG_S:.0f} s of the "
                                 f"generation's end (killed: {kill.label if kill else 'nothing'})", zero=True)
        writer_killed = role is not None and role[0] == "writer"
        reader_killed = role[1] if role is not None and role[0] == "reader" else None

        def unexpected(what):
            rep.count("queue unexpected errors")
            rep.finding("queue", f"{tag}: {what} (killed: {kill.label if kill else 'nothing'})", zero=True)

        # the writer's outcome
        if not writer_killed and writer not in hung:
            if w_report is None:
                unexpected(f"the writer exited (code {writer.exitcode}) without a report")
            elif w_report["end"] == "dead_peer":
                if reader_killed is None:
                    unexpected(f"the writer got DeadPeerError with no reader killed: {w_report['error']}")
                else:
                    kill.detected_s.append(w_report["t"] - kill.t)
            elif w_report["end"] != "stopped":
                unexpected(f"the writer ended with {w_report['end']}: {w_report['error']}")
            elif kill is not None and reader_killed is not None:
                kill.note = "the run ended before the writer noticed"
            if w_report is not None and w_report["sent"] != sent:
                unexpected(f"the writer reports {w_report['sent']} sent, its counter {sent}")
        # every surviving reader
        for rank, p in enumerate(readers):
            if rank == reader_killed or p in hung:
                continue
            r = r_reports.get(rank)
            if r is None:
                unexpected(f"reader r{rank} exited (code {p.exitcode}) without a report")
                continue
            if writer_killed:
                if r["end"] == "dead_peer":
                    kill.detected_s.append(r["t"] - kill.t)
                else:
                    unexpected(f"reader r{rank} ended with {r['end']} after its writer was killed: {r['error']}")
            elif r["end"] != "closed":
                unexpected(f"reader r{rank} ended with {r['end']}: {r['error']}")
            tail = sent - (r["max_seq"] + 1)  # -1: the writer died between an enqueue and its counter update
            t = self.totals[rank]
            t.generations += 1
            t.sent += sent
            t.received += r["received"]
            t.dup += r["dup"]
            t.ooo += r["ooo"]
            t.bad += r["bad"] + r["foreign"]
            lost = r["gaps"]
            if tail > 0 and writer_killed and rank >= self.n_local:
                t.inflight_at_writer_kill += tail
            elif tail > 0:
                lost += tail
            t.lost += lost
            for what, n in (("lost", lost), ("duplicated", r["dup"]), ("out of order", r["ooo"]),
                            ("corrupt or foreign", r["bad"] + r["foreign"])):
                if n:
                    rep.finding("queue", f"{tag}: reader r{rank} ({self.rank_kind(rank)}): {n} message(s) {what} "
                                         f"of {sent} sent (received {r['received']}, last seq {r['max_seq']}, "
                                         f"killed: {kill.label if kill else 'nothing'})", zero=True)
        for p in [writer, *readers]:
            killed = (p is writer and writer_killed) or (reader_killed is not None and p is readers[reader_killed])
            if not killed and p not in hung and p.exitcode not in (0, None):
                unexpected(f"{p.name} exited with code {p.exitcode}")


# ---------------------------------------------------------------------------------------------------------------
# requests: the mix sent to the engine and the orchestrator

_WORDS = ["alpha", "beta", "gamma", "delta", "soak", "chaos", "queue", "token", "ring", "engine"]


def _good_request(rng: random.Random) -> dict:
    prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(1, 8)))
    return {"prompt": prompt, "max_tokens": rng.randrange(4, 40), "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": rng.randrange(1 << 31)}


# name -> the generate() arguments of a bad request. Each must end with a clear error (or be served); none may
# hang, kill the engine or fail another request.
BAD_REQUESTS = {
    "temperature=nan": lambda: {"prompt": "nan", "max_tokens": 8, "temperature": float("nan")},
    "temperature=1e-310": lambda: {"prompt": "tiny", "max_tokens": 8, "temperature": 1e-310},
    "temperature=inf": lambda: {"prompt": "inf", "max_tokens": 8, "temperature": float("inf")},
    "temperature=-1": lambda: {"prompt": "neg", "max_tokens": 8, "temperature": -1.0},
    "temperature='hot'": lambda: {"prompt": "str", "max_tokens": 8, "temperature": "hot"},
    "token id 300 (vocabulary)": lambda: {"prompt": [1, 300, 2], "max_tokens": 8},
    "token id -3": lambda: {"prompt": [-3], "max_tokens": 8},
    "token id 'a'": lambda: {"prompt": ["a"], "max_tokens": 8},
    "empty prompt": lambda: {"prompt": [], "max_tokens": 8},
    "prompt None": lambda: {"prompt": None, "max_tokens": 8},
    "max_tokens=0": lambda: {"prompt": "zero", "max_tokens": 0},
    "max_tokens=10**9": lambda: {"prompt": "huge", "max_tokens": 10**9},
    "max_tokens='many'": lambda: {"prompt": "many", "max_tokens": "many"},
    "stop_token_ids=['x']": lambda: {"prompt": "stop", "max_tokens": 8, "stop_token_ids": ["x"]},
    "seed=2**64": lambda: {"prompt": "seed", "max_tokens": 8, "temperature": 1.0, "seed": 2**64},
}
CLEAR_REJECTIONS = (ValueError, TypeError, OverflowError)  # RequestError is a ValueError


@dataclass
class RequestTally:
    good_finished: int = 0
    good_failed_by_kill: int = 0  # EngineDeadError / ReplicaDeadError while a chaos kill explains it
    good_failed_unexpected: int = 0
    bad_rejected: dict = field(default_factory=dict)  # exception type -> count
    bad_served: int = 0
    bad_failed_by_kill: int = 0
    bad_unexpected: int = 0  # a bad request that ended in something other than a clear error or a normal finish
    hung: int = 0
    deaths_unexplained: int = 0
    restarts: int = 0

    def as_dict(self):
        return dict(self.__dict__)


class _Hung(Exception):
    pass


async def _drive(agen, hang_s: float) -> list:
    """Every output of one request; _Hung if any next output takes longer than hang_s (the request is then
    closed, which aborts it)."""
    outs = []
    try:
        while True:
            try:
                async with asyncio.timeout(hang_s):
                    out = await agen.__anext__()
            except StopAsyncIteration:
                return outs
            except TimeoutError:
                raise _Hung(f"no output within {hang_s:.0f} s after {len(outs)} output(s)") from None
            outs.append(out)
    finally:
        await agen.aclose()


class _RequestLoad:
    """What EngineLoad and OrchestratorLoad share: one request of the good/bad mix, driven to its end, and its
    outcome tallied. Subclasses set report, rng, bad_ratio, tally, area (the report's area and label) and
    _inflight_bad / _ids."""

    area = ""

    async def _request(self, start, death_error, explain_death, unexplained: str) -> bool:
        """Run one request (start(request_id, kwargs) -> its output stream); True if it finished."""
        bad = self.rng.random() < self.bad_ratio
        name = self.rng.choice(list(BAD_REQUESTS)) if bad else "good"
        kwargs = BAD_REQUESTS[name]() if bad else _good_request(self.rng)
        self._ids += 1
        key = self._ids
        if bad:
            self._inflight_bad[key] = name
        t = self.tally
        try:
            # a leftover entry in the orchestrator names the kind of request that left it
            outs = await _drive(start(f"soak-{key}-{name}", kwargs), HANG_S)
            if outs and outs[-1].finished:
                if bad:
                    t.bad_served += 1
                else:
                    t.good_finished += 1
                return True
            self._unexpected(bad, name, f"the stream ended without a finished output ({len(outs)} outputs)")
        except _Hung as e:
            t.hung += 1
            self.report.finding(self.area, f"{self.label}request {name!r} hung: {e}", zero=True)
        except death_error as e:
            if explain_death(e):
                if bad:
                    t.bad_failed_by_kill += 1
                else:
                    t.good_failed_by_kill += 1
            else:
                self._unexpected(bad, name, f"{unexplained}: {e}")
        except CLEAR_REJECTIONS as e:
            if bad:
                t.bad_rejected[type(e).__name__] = t.bad_rejected.get(type(e).__name__, 0) + 1
            else:
                self._unexpected(bad, name, f"a good request failed: {e!r}")
        except Exception as e:
            self._unexpected(bad, name, f"{e!r}")
        finally:
            self._inflight_bad.pop(key, None)
        return False

    @property
    def label(self) -> str:
        return ""

    def _unexpected(self, bad, name, what):
        if bad:
            self.tally.bad_unexpected += 1
        else:
            self.tally.good_failed_unexpected += 1
        self.report.finding(self.area, f"{self.label}request {name!r}: {what}", zero=True)


class EngineLoad(_RequestLoad):
    """An AsyncEngineClient (multiproc executor) serving `concurrency` request streams; restarted when it dies."""

    def __init__(self, name: str, report: "Report", rng: random.Random, concurrency: int = 3, bad_ratio: float = 0.2,
                 step_delay_s: float = 0.01):
        self.name, self.report, self.rng = name, report, rng
        self.concurrency, self.bad_ratio, self.step_delay_s = concurrency, bad_ratio, step_delay_s
        self.tally = RequestTally()
        self.client = None
        self._pending_kill: Kill | None = None
        self._death_explained = False
        self._inflight_bad: dict[int, str] = {}
        self._ids = 0

    area = "engine"

    @property
    def label(self) -> str:
        return f"{self.name}: "

    @property
    def ready(self) -> bool:
        return self.client is not None

    def targets(self) -> list[Target]:
        c = self.client
        if c is None or self._pending_kill is not None:
            return []
        out = [Target("engine", f"{self.name} engine", c.engine_pid, lambda: self._kill("engine", c, c.engine_pid))]
        for pid in sorted(children_of(c.engine_pid)):
            out.append(Target("engine worker", f"{self.name} worker", pid,
                              lambda pid=pid: self._kill("engine worker", c, pid)))
        return out

    def _kill(self, kind, client, pid) -> Kill | None:
        if client is not self.client or self._pending_kill is not None:
            return None
        if not send_signal(pid, signal.SIGKILL):
            return None  # gone already, or the pid is no longer ours
        self._pending_kill = Kill(kind, f"{self.name} {kind}", pid, time.monotonic())
        return self._pending_kill

    async def run(self, stop: asyncio.Event):
        from hotloop.engine.client import AsyncEngineClient

        first = True
        while not stop.is_set():
            try:
                client = await AsyncEngineClient.start("tiny", executor="multiproc", tp=1,
                                                       step_delay_s=self.step_delay_s, start_timeout=START_TIMEOUT_S)
            except Exception as e:
                self.report.finding("engine", f"{self.name}: the engine did not start: {e!r}", zero=True)
                self.report.count("engine start failures")
                await asyncio.sleep(1)
                continue
            if not first:
                self.tally.restarts += 1
            first = False
            dead = asyncio.Event()
            self.client = client
            users = [asyncio.create_task(self._user(client, stop, dead)) for _ in range(self.concurrency)]
            await asyncio.gather(*users)
            self.client = None
            self._pending_kill = None
            await client.shutdown()

    async def _user(self, client, stop, dead):
        while not stop.is_set() and not dead.is_set():
            await self._one(client, dead)
            await asyncio.sleep(0)  # a request rejected at once must not starve the event loop

    async def _one(self, client, dead) -> bool:
        from hotloop.engine.client import EngineDeadError

        return await self._request(lambda rid, kw: client.generate(**kw, request_id=rid), EngineDeadError,
                                   lambda e: self._on_death(e, dead), "failed when the engine died with no kill")

    def _on_death(self, e, dead: asyncio.Event) -> bool:
        """The first EngineDeadError of an incarnation times its kill; True if a chaos kill explains the death."""
        if dead.is_set():
            return self._death_explained
        dead.set()
        kill, self._pending_kill = self._pending_kill, None
        if kill is not None:
            kill.detected_s.append(time.monotonic() - kill.t)
        else:
            self.tally.deaths_unexplained += 1
            bad = sorted(set(self._inflight_bad.values()))
            self.report.finding("engine", f"{self.name}: the engine died with no kill: {e} (bad requests in flight: "
                                          f"{bad or 'none'})", zero=True)
        self._death_explained = kill is not None  # the other requests of this incarnation fail of the same death
        return self._death_explained


class OrchestratorLoad(_RequestLoad):
    """An Orchestrator (two LLM replicas streaming into one transform replica) under a stream of requests; a dead
    replica is replaced with add_replica."""

    STAGE_REPLICAS = (2, 1)
    area = "orchestrator"

    def __init__(self, report: "Report", rng: random.Random, concurrency: int = 4, bad_ratio: float = 0.2,
                 step_delay_s: float = 0.01):
        self.report, self.rng = report, rng
        self.concurrency, self.bad_ratio, self.step_delay_s = concurrency, bad_ratio, step_delay_s
        self.tally = RequestTally()
        self.orch = None
        self.evictions_explained: set[str] = set()
        self._kills: dict[str, Kill] = {}  # replica name -> the chaos kill of it
        self._seen_dead: set[str] = set()
        self._adding = [0, 0]
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()
        self._inflight_bad: dict[int, str] = {}
        self._ids = 0

    @property
    def ready(self) -> bool:
        return self.orch is not None

    def targets(self) -> list[Target]:
        if self.orch is None:
            return []
        out = []
        for st in self.orch.stages:
            for r in st.replicas:
                if r.alive and r.name not in self._kills:
                    out.append(Target("replica", f"replica {r.name}", r.pid,
                                      lambda r=r, si=st.index: self._kill(r, si)))
        return out

    def _kill(self, replica, stage_index) -> Kill | None:
        if not replica.alive or replica.name in self._kills:
            return None
        send_signal(replica.pid, signal.SIGKILL)
        k = self._kills[replica.name] = Kill("replica", f"replica {replica.name}", replica.pid, time.monotonic())
        self._heal()
        return k

    def _heal(self):
        """Start replacements for every stage below its replica count (a replica that died, killed or not)."""
        if self.orch is None or self._stopping:
            return
        for st in self.orch.stages:
            live = sum(1 for r in st.replicas if r.alive)
            for _ in range(self.STAGE_REPLICAS[st.index] - live - self._adding[st.index]):
                self._adding[st.index] += 1
                task = asyncio.create_task(self._add(st.index))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _add(self, stage_index):
        try:
            await self.orch.add_replica(stage_index)
            self.tally.restarts += 1
        except Exception as e:
            self.report.finding("orchestrator", f"add_replica({stage_index}) failed: {e!r}", zero=True)
            self.report.count("orchestrator start failures")
        finally:
            self._adding[stage_index] -= 1

    async def run(self, stop: asyncio.Event):
        from hotloop.orchestrator import Orchestrator, StageSpec

        self._stopping = False
        llm = {"model": "tiny", "step_delay_s": self.step_delay_s}
        self.orch = await Orchestrator.start([StageSpec("llm", replicas=2, options=llm, stream_chunk_tokens=4),
                                              StageSpec("transform")])
        users = [asyncio.create_task(self._user(stop)) for _ in range(self.concurrency)]
        healer = asyncio.create_task(self._heal_schedule())
        await asyncio.gather(*users)
        self._stopping = True
        healer.cancel()
        await asyncio.gather(healer, *self._tasks, return_exceptions=True)
        left = len(self.orch._requests)  # white-box: every request ended, so none may stay registered
        if left:
            self.report.count("orchestrator request entries left", left)
            kinds = sorted({rid.split("-", 2)[2] for rid in self.orch._requests if rid.startswith("soak-")})
            self.report.finding("orchestrator", f"{left} request entries stay in the orchestrator after their requests "
                                                f"ended, left by the requests {kinds}", zero=True)
        self.tally.evictions = self.orch.monitor.evictions
        extra = self.tally.evictions - len(self._kills)  # every kill evicts one replica; any other eviction is a death
        if extra > self.tally.deaths_unexplained:
            self.report.finding("orchestrator", f"{self.tally.evictions} evictions for {len(self._kills)} replica kills",
                                zero=True)
            self.tally.deaths_unexplained = extra
        orch, self.orch = self.orch, None
        await orch.shutdown()

    async def _heal_schedule(self):
        """A replica that died while no request was bound to it is evicted silently: replace it too."""
        while True:
            await asyncio.sleep(2)
            self._heal()

    async def _user(self, stop):
        while not stop.is_set():
            started = time.monotonic()
            await self._one()
            # A request that ends without suspending (no live replica while one restarts, a rejection) must not
            # starve the event loop, the healer included: pace those. Load pacing, not a data path.
            await asyncio.sleep(0 if time.monotonic() - started > 0.01 else 0.05)

    async def _one(self) -> bool:
        from hotloop.orchestrator import ReplicaDeadError

        def start(rid, kw):
            prompt, max_tokens = kw.pop("prompt"), kw.pop("max_tokens")
            return self.orch.generate(prompt, max_tokens, request_id=rid, **kw)

        return await self._request(start, ReplicaDeadError, lambda e: self._on_replica_error(str(e)),
                                   "failed on a replica no kill explains")

    def _on_replica_error(self, msg: str) -> bool:
        """Time the kill it reports (first error naming the replica); False if no kill explains it."""
        self._heal()
        m = re.search(r"replica ([\w.-]+?)(?: of stage|:| is not running| was shut down)", msg)
        if m is None:  # "stage N has no live replica": explained if a kill left the stage short
            return bool(self._kills)
        rname = m.group(1)
        kill = self._kills.get(rname)
        if kill is None:
            if rname not in self._seen_dead:
                self._seen_dead.add(rname)
                self.tally.deaths_unexplained += 1
                bad = sorted(set(self._inflight_bad.values()))
                self.report.finding("orchestrator", f"replica {rname} died with no kill: {msg} (bad requests in "
                                                    f"flight: {bad or 'none'})", zero=True)
            return False
        if not kill.detected_s:
            kill.detected_s.append(time.monotonic() - kill.t)
        return True



# ---------------------------------------------------------------------------------------------------------------
# chaos


class Chaos:
    """Seeded: every ~mean_interval_s, one action on one random target: SIGKILL, SIGSTOP for 0.1-2 s then SIGCONT,
    or garbage sent to a queue's publisher port."""

    def __init__(self, rng: random.Random, components: list, report: "Report", mean_interval_s: float = 3.0):
        self.rng, self.components, self.report = rng, components, report
        self.mean_interval_s = mean_interval_s
        self.actions: dict[str, int] = {}

    def _did(self, what: str):
        self.actions[what] = self.actions.get(what, 0) + 1

    async def run(self, until: float):
        rng = self.rng
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, max(0.3, rng.expovariate(1 / self.mean_interval_s))))
            if time.monotonic() >= until:
                return
            targets = [t for c in self.components for t in c.targets()]
            if not targets:
                continue
            kind = rng.choice(sorted({t.kind for t in targets}))
            target = rng.choice([t for t in targets if t.kind == kind])
            if target.address:
                await self._garbage(target)
            elif rng.random() < 0.55:
                kill = target.kill()
                if kill is not None:
                    self.report.kills.append(kill)
                    self._did(f"kill {target.kind}")
                    _log(f"chaos: SIGKILL {target.label} (pid {target.pid})")
            else:
                await self._stop(target, rng.uniform(0.1, 2.0))

    async def _stop(self, target: Target, seconds: float):
        start = _start_time(target.pid)
        if start is None:
            return
        if not send_signal(target.pid, signal.SIGSTOP):
            return
        self._did(f"stop {target.kind}")
        _log(f"chaos: SIGSTOP {target.label} (pid {target.pid}) for {seconds:.2f} s")
        try:
            await asyncio.sleep(seconds)
        finally:
            if _start_time(target.pid) == start:  # not a reused pid (send_signal checks it is ours too)
                send_signal(target.pid, signal.SIGCONT)

    async def _garbage(self, target: Target):
        seed = self.rng.randrange(1 << 30)
        self._did("garbage to a queue port")
        _log(f"chaos: garbage to {target.label}")
        try:
            await asyncio.to_thread(send_garbage, target.address, seed)
        except Exception as e:
            self.report.finding("chaos", f"sending garbage to {target.address} failed in the soak: {e!r}")


def send_garbage(address: str, seed: int) -> None:
    """Connect to a queue's publisher as a stranger and send junk: raw TCP bytes, then ZeroMQ sockets of several
    types with random frames (subscriptions, unsubscriptions, bytes). Everything is closed before returning."""
    import zmq

    rng = random.Random(seed)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    assert host == LOOPBACK, f"garbage must stay on loopback, not {host}"
    try:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(rng.randbytes(rng.randrange(1, 4096)))
            s.sendall(b"\xff" + rng.randbytes(9) + b"\x7f" + rng.randbytes(64))  # a ZMTP-looking greeting, wrong
    except (ConnectionResetError, BrokenPipeError, ConnectionRefusedError):
        pass  # the publisher hung up on the junk (or its queue just ended): what it should do
    ctx = zmq.Context()
    try:
        for kind in (zmq.XSUB, zmq.SUB, zmq.DEALER, zmq.PUB):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            for _ in range(rng.randrange(1, 6)):
                frame = bytes([rng.choice([0, 1, rng.randrange(256)])]) + rng.randbytes(rng.randrange(0, 40))
                try:
                    if kind == zmq.SUB:
                        sock.setsockopt(zmq.SUBSCRIBE, frame)
                    else:
                        sock.send(frame, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            time.sleep(0.05)  # let the handshake and frames reach the publisher before closing
            sock.close(0)
    finally:
        ctx.term()


# ---------------------------------------------------------------------------------------------------------------
# the report


class Report:
    def __init__(self):
        self.kills: list[Kill] = []
        self.counts: dict[str, int] = {}
        self.findings: list[dict] = []

    def count(self, what: str, n: int = 1):
        self.counts[what] = self.counts.get(what, 0) + n

    def finding(self, area: str, what: str, zero: bool = False):
        self.findings.append({"area": area, "what": what, "t": time.monotonic()})
        if len([f for f in self.findings if f["what"] == what]) == 1:
            _log(f"FINDING [{area}] {what}")

    def build(self, cfg: dict, groups: list[QueueGroup], engine: EngineLoad, orch: OrchestratorLoad, chaos: Chaos,
              leaks: dict, goal_s: float, fail_on_goal: bool) -> dict:
        rows = []  # (section, name, value, must_be_zero)

        def row(section, name, value, zero=False):
            rows.append({"section": section, "name": name, "value": value, "must_be_zero": zero})

        for g in groups:
            for rank, t in g.totals.items():
                sec = f"queue q{g.wid} reader r{rank} ({g.rank_kind(rank).removeprefix('queue ')})"
                row(sec, "generations survived", t.generations)
                row(sec, "messages sent", t.sent)
                row(sec, "messages received", t.received)
                row(sec, "lost", t.lost, True)
                row(sec, "duplicated", t.dup, True)
                row(sec, "out of order", t.ooo, True)
                row(sec, "corrupt or foreign", t.bad, True)
                if rank >= g.n_local:
                    row(sec, "in flight when its writer was killed (documented)", t.inflight_at_writer_kill)
        row("queue", "generations", sum(g.generations for g in groups))
        row("queue", "messages sent (all writers)", sum(g.sent for g in groups))
        row("queue", "unexpected errors", self.counts.get("queue unexpected errors", 0), True)
        row("queue", "start failures", self.counts.get("queue start failures", 0), True)
        row("queue", "processes hung", self.counts.get("queue processes hung", 0), True)
        for label, load in (("engine", engine), ("orchestrator", orch)):
            t = load.tally
            row(label, "good requests finished", t.good_finished)
            row(label, "requests failed by a kill (clear error)", t.good_failed_by_kill + t.bad_failed_by_kill)
            row(label, "bad requests rejected (clear error)", sum(t.bad_rejected.values()))
            row(label, "bad requests served", t.bad_served)
            row(label, "requests hung", t.hung, True)
            row(label, "good requests failed, no kill", t.good_failed_unexpected, True)
            row(label, "bad requests, unclear outcome", t.bad_unexpected, True)
            row(label, "deaths no kill explains", t.deaths_unexplained, True)
            row(label, "restarts", t.restarts)
            row(label, "start failures", self.counts.get(f"{label} start failures", 0), True)
        row("orchestrator", "evictions", getattr(orch.tally, "evictions", 0))
        row("orchestrator", "request entries left", self.counts.get("orchestrator request entries left", 0), True)
        for what, n in sorted(chaos.actions.items()):
            row("chaos", what, n)
        by_kind: dict[str, list[float]] = {}
        unobserved = 0
        for k in self.kills:
            if k.detected_s:
                by_kind.setdefault(k.kind, []).extend(k.detected_s)
            else:
                unobserved += 1
        all_s = [x for xs in by_kind.values() for x in xs]
        latency = {kind: percentiles(xs) for kind, xs in sorted(by_kind.items())}
        latency["all"] = percentiles(all_s)
        row("kill to error", "kills with no survivor error observed", unobserved)
        row("leaks", "/dev/shm/hotloop-* entries", len(leaks["shm"]), True)
        row("leaks", "/dev/shm/hotloop-* of other programs (not counted)", len(leaks["shm_of_other_programs"]))
        row("leaks", "child processes", len(leaks["children"]), True)
        row("leaks", "file descriptors", len(leaks["fds"]), True)
        row("leaks", "threads (informational)", len(leaks["threads"]))
        zero_fail = [r for r in rows if r["must_be_zero"] and r["value"]]
        worst = latency["all"]["max"]
        goal_missed = worst is not None and worst > goal_s
        ok = not zero_fail and not (goal_missed and fail_on_goal)
        return {"config": cfg, "rows": rows, "kill_to_error_s": latency, "goal_s": goal_s, "goal_missed": goal_missed,
                "fail_on_goal": fail_on_goal, "failed_rows": [f"{r['section']}: {r['name']}" for r in zero_fail],
                "kills": [{"kind": k.kind, "label": k.label, "pid": k.pid, "detected_s": k.detected_s,
                           "note": k.note} for k in self.kills],
                "findings": self.findings, "leaks": leaks, "ok": ok,
                "engine": engine.tally.as_dict(), "orchestrator": orch.tally.as_dict()}

    @staticmethod
    def render(rec: dict) -> str:
        lines = [f"hotloop soak: {rec['config']['minutes']} min, seed {rec['config']['seed']}"]
        section = None
        for r in rec["rows"]:
            if r["section"] != section:
                section = r["section"]
                lines.append(f"\n{section}")
            flag = ""
            if r["must_be_zero"]:
                flag = MUST_BE_ZERO if not r["value"] else f"{MUST_BE_ZERO}  <-- FAIL"
            lines.append(f"  {r['name']:<52} {r['value']:>10}  {flag}")
        lines.append(f"\nkill to error (s){'':<36}{'n':>4} {'p50':>8} {'p99':>8} {'max':>8}")

        def f(x):
            return "-" if x is None else f"{x:.3f}"

        for kind, p in rec["kill_to_error_s"].items():
            lines.append(f"  {kind:<50} {p['n']:>4} {f(p['p50']):>8} {f(p['p99']):>8} {f(p['max']):>8}")
        goal = rec["goal_s"]
        verdict = "missed" if rec["goal_missed"] else "met"
        lines.append(f"  goal: max <= {goal:g} s: {verdict}{'' if rec['fail_on_goal'] else ' (reported, not failed on)'}")
        if rec["findings"]:
            uniq = list(dict.fromkeys(f"[{x['area']}] {x['what']}" for x in rec["findings"]))
            lines.append(f"\nfindings ({len(rec['findings'])}, {len(uniq)} distinct):")
            lines += [f"  - {u}" for u in uniq[:40]]
            if len(uniq) > 40:
                lines.append(f"  ... {len(uniq) - 40} more in the JSON record")
        lines.append(f"\nresult: {'PASS' if rec['ok'] else 'FAIL'}"
                     + ("" if rec["ok"] else f" ({', '.join(rec['failed_rows']) or 'kill-to-error goal'})"))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the run


class Soak:
    def __init__(self, minutes: float, seed: int, report: Report, workdir: str):
        self.minutes, self.seed, self.report = minutes, seed, report
        rng = random.Random(seed)
        self.groups = [QueueGroup(0, 3, 2, report, seed, workdir), QueueGroup(1, 3, 1, report, seed, workdir)]
        self.engine = EngineLoad("e0", report, random.Random(rng.random()))
        self.orch = OrchestratorLoad(report, random.Random(rng.random()))
        self.chaos = Chaos(random.Random(rng.random()), [*self.groups, self.engine, self.orch], report)
        self.pids: set[int] = {os.getpid()}

    async def run(self):
        stop = asyncio.Event()
        tracker = asyncio.create_task(self.track_processes())
        for g in self.groups:
            g.start()
        loads = [asyncio.create_task(self.engine.run(stop), name="soak-engine"),
                 asyncio.create_task(self.orch.run(stop), name="soak-orchestrator")]
        _log("starting: 2 queue groups, 1 engine, 1 orchestrator (2 LLM replicas + 1 transform)")
        t0 = time.monotonic()
        while not (all(g.ready for g in self.groups) and self.engine.ready and self.orch.ready):
            if time.monotonic() - t0 > START_TIMEOUT_S or any(t.done() for t in loads):
                break
            await asyncio.sleep(0.2)  # start-up only
        _log(f"running {self.minutes:g} min with chaos (started in {time.monotonic() - t0:.1f} s)")
        until = time.monotonic() + self.minutes * 60
        progress = asyncio.create_task(self._progress(until))
        await self.chaos.run(until)
        progress.cancel()
        await asyncio.gather(progress, return_exceptions=True)
        _log("chaos over: stopping the load; every outcome must arrive")
        stop.set()
        for g in self.groups:
            g.stop()
        done, pending = await asyncio.wait(loads, timeout=2 * HANG_S + 30)
        for t in pending:
            self.report.count(f"{t.get_name().removeprefix('soak-')} did not stop")
            self.report.finding("soak", f"{t.get_name()} did not stop within {2 * HANG_S + 30:.0f} s", zero=True)
            t.cancel()
        for t in done:
            if t.exception() is not None:
                self.report.finding("soak", f"{t.get_name()} failed: {t.exception()!r}", zero=True)
        for g in self.groups:
            if not await asyncio.to_thread(g.join, HANG_S + 10):
                self.report.count("queue processes hung")
                self.report.finding("queue", f"q{g.wid}: the group did not stop", zero=True)
        tracker.cancel()
        await asyncio.gather(tracker, return_exceptions=True)
        for g in self.groups:
            self.pids |= g.pids

    async def track_processes(self):
        """Every process of this soak's tree, sampled twice a second: tells its /dev/shm segments from those of
        other programs running on the machine (a monitor, not a data path)."""
        me = os.getpid()
        while True:
            self.pids |= descendants_of(me)
            await asyncio.sleep(0.5)

    async def _progress(self, until):
        while True:
            await asyncio.sleep(10)
            e, o = self.engine.tally, self.orch.tally
            _log(f"{max(0.0, until - time.monotonic()):.0f} s left: queue sent {sum(g.sent for g in self.groups)} "
                 f"in {sum(g.generations for g in self.groups)} generations; engine {e.good_finished} ok, "
                 f"{sum(e.bad_rejected.values())} rejected; orchestrator {o.good_finished} ok; "
                 f"kills {len(self.report.kills)}; findings {len(self.report.findings)}")


def run(minutes: float = 1.0, seed: int = 0, json_path: str | None = None, goal_s: float = 1.0,
        fail_on_goal: bool = True) -> int:
    """Run the soak; print the table on stdout; return the exit code (0: every must-be-0 row is 0 and the goal)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # kept for the whole process: not a leak
    import hotloop.engine.client  # noqa: F401  (imports done before the descriptor baseline)
    import hotloop.orchestrator  # noqa: F401
    import zmq  # noqa: F401

    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)  # children inherit stdout: their prints go to stderr, the table alone to stdout
    workdir = tempfile.mkdtemp(prefix="hotloop-soak-")
    me = os.getpid()
    shm0, kids0, fds0, threads0 = shm_entries(), children_of(me), open_fds(), set(threading.enumerate())
    report = Report()
    soak = Soak(minutes, seed, report, workdir)
    try:
        asyncio.run(soak.run())
    finally:
        deadline = time.monotonic() + 10
        while True:  # end of run: processes exit and segments go away asynchronously
            gc.collect()
            kids = children_of(me) - kids0
            shm = shm_entries() - shm0
            fds = open_fds() - fds0
            threads = [t for t in threading.enumerate() if t not in threads0 and t.is_alive()]
            if not (kids or shm or fds or threads) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        fd_names = {}
        for fd in fds:
            try:
                fd_names[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        ours = {x for x in shm if _creator_pid(x) in soak.pids}
        leaks = {"shm": sorted(ours), "shm_of_other_programs": sorted(shm - ours), "children": sorted(kids), "fds": fd_names,
                 "threads": [t.name for t in threads]}
        for pid in kids:  # report them, then do not leave them behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    cfg = {"minutes": minutes, "seed": seed, "hang_s": HANG_S, "loopback": LOOPBACK, "cpus": os.cpu_count()}
    rec = report.build(cfg, soak.groups, soak.engine, soak.orch, soak.chaos, leaks, goal_s, fail_on_goal)
    print(Report.render(rec), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rec, f, indent=2, default=str)
        _log(f"wrote {json_path}")
    return 0 if rec["ok"] else 1
