"""The soak's queue load: ``QueueGroup``, one MessageQueue writer with shared-memory and remote (TCP) readers,
recreated as a new generation whenever chaos kills one of its processes.

Contract:

- Each message is ``(writer id, generation, sequence, crc32, payload)``, its size random (up to several times the
  ring). Readers block in ``dequeue`` and check every message: none lost, none duplicated, in order, checksum
  good. The writer counts what ``enqueue`` accepted in a file that survives its SIGKILL.
- One kill per generation (``targets()`` offers none once one hit), so its survivors' errors are unambiguous:
  the writer's DeadPeerError for a dead reader, the readers' for a dead writer, and, when the reader killed was
  its node's relay (remote readers of a node share one stream: ``queue/relay.py``) or another reader of that
  node (whose dead cursor stops the relay once the node's ring is full behind it), the DeadPeerError of the
  node's other readers, whose tail the relay had not yet written is counted as in flight, not lost (documented
  there). When every process of the
  generation ended (or HANG_S passed: hung, killed, counted), ``_account`` adds the readers' counts to
  ``totals`` and reports every loss, duplicate, reordering or unexpected error as a finding.
- A controller thread per group runs the generations; ``stop()`` ends the current one cleanly (the writer shuts
  the queue down) and starts no other.
- On simulated nodes (``hotloop soak --network``, ``nodes``: a ``SoakNodes``) each process joins its node's
  network namespace first; a proxied rank reads through a delay proxy on its own node. ``net_targets`` /
  ``begin_fault`` / ``end_fault`` let ``NetworkChaos`` put one fault at a time on a live generation (no kill
  then); a partition ends the generation as a kill does: the writer's and the cut-off reader's DeadPeerError
  are its detection, what that reader never received is not lost (it was cut off), and the node is healed
  before the next generation. Each process reports the descriptors its queue left open after ``close()``.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import multiprocessing.connection as mpc
import os
import random
import signal
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hotloop.soak.chaos import Target
from hotloop.soak.findings import Findings, Kill
from hotloop.soak.net_fault import PARTITION, NetFault
from hotloop.soak.own_processes import CTX, HANG_S, LOOPBACK, START_TIMEOUT_S, die_with_parent, send_signal

if TYPE_CHECKING:
    from hotloop.soak.nodes import SoakNodes


def _on_node(netns: str | None) -> None:
    """A node's process joins its network namespace before it opens any socket (None: stays on loopback)."""
    if netns is not None:
        from hotloop.testing.netns import join

        join(netns)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))

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
                 counter_path: str, connect_ip: str = LOOPBACK, netns: str | None = None) -> None:
    """One generation's writer: sends until told to stop (or a reader dies), then shuts the queue down and
    reports. After each enqueue that returned, the count of sent messages is in `counter_path` (it survives a
    SIGKILL of this process). After close(), ("closed", descriptors the queue left open)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _on_node(netns)
    from hotloop import ClosedError, DeadPeerError, MessageQueue

    fd = os.open(counter_path, os.O_RDWR)
    counter = mmap.mmap(fd, 8)
    os.close(fd)
    fds0 = _fd_count()
    q = MessageQueue(n_reader, n_local_reader=n_local, max_chunk_bytes=max_chunk, connect_ip=connect_ip,
                     bind_ip=connect_ip)
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
    ctrl.send(("closed", _fd_count() - fds0))


def _reader_main(handle, rank: int, wid: int, gen: int, conn, netns: str | None = None) -> None:
    """One reader: blocks in dequeue, checks every message, reports when the queue ends (closed / dead writer),
    then, after close(), the descriptors its queue left open."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _on_node(netns)
    from hotloop import ClosedError, DeadPeerError, MessageQueue

    fds0 = _fd_count()
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
    conn.send({"fds_left": _fd_count() - fds0})


def _proxy_main(netns: str, port: int, writer_ip: str, conn) -> None:
    """A proxied rank's delay proxy, on the rank's node: 127.0.0.1:port -> the writer's publisher, delay off
    until SIGUSR1 (hotloop.testing.delay_proxy); ends once its one connection ended."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _on_node(netns)
    import asyncio

    from hotloop.testing.delay_proxy import serve

    asyncio.run(serve(LOOPBACK, port, writer_ip, port, 20.0, 5.0, connections=1, switched=True,
                      ready=lambda: conn.send("ready")))


def _lost_its_relay(report: dict, killed, killed_on_its_node: bool) -> bool:
    """Whether a remote reader ended because its node's relay stopped (``queue/relay.py``), and the kill of this
    generation explains it. Its DeadPeerError names the node's ring (``hotloop-node-...``) and either names the
    killed process as that ring's writer (the killed reader was the relay), or says the relay abandoned the ring
    and the killed reader was another reader of the node (`killed_on_its_node`): a relayed reader that dies while
    the node's ring is full behind it makes the relay's write raise DeadPeerError, and the relay then abandons the
    ring, as it does when it loses the writer."""
    if killed is None or report["end"] != "dead_peer" or "/hotloop-node-" not in report["error"]:
        return False
    return f"(pid {killed.pid})" in report["error"] or (killed_on_its_node and "lost its own source" in report["error"])


@dataclass
class ReaderTotals:
    sent: int = 0
    received: int = 0
    lost: int = 0
    dup: int = 0
    ooo: int = 0
    bad: int = 0
    inflight_at_writer_kill: int = 0  # remote tail a killed writer never sent (documented: ZeroMQ sends later)
    inflight_at_relay_kill: int = 0  # tail a stopped relay had not written into its node's ring (documented)
    cut_off_tail: int = 0  # what a partitioned reader never received after its node was cut off (not lost)
    generations: int = 0


class QueueGroup:
    """One writer and its readers, recreated as a new generation whenever chaos kills one of them."""

    def __init__(self, wid: int, n_reader: int, n_local: int, report: Findings, seed: int, workdir: str,
                 max_chunk: int = 16 << 10, rate: float = 100.0, nodes: SoakNodes | None = None):
        self.wid, self.n_reader, self.n_local = wid, n_reader, n_local
        self.nodes = nodes
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
        self._cond = threading.Condition(self._lock)  # signalled when a network fault ends
        self._fault: NetFault | None = None  # the network fault on the live generation, if any
        self._gen_faults: list[NetFault] = []  # every network fault of the current generation
        self._proxies: tuple[int, dict] = (0, {})  # (generation, rank -> delay proxy pid)
        self._thread = threading.Thread(target=self._run, name=f"soak-queue-{wid}", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        with self._lock:
            self._stopping = True
            self._live = None
            self._cond.notify_all()
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
            if self._live is None or self._fault is not None:  # a network fault's outcome stays unambiguous
                return []
            gen, writer, readers, _, address = self._live
        out = [Target("queue writer", f"q{self.wid}.g{gen} writer", writer.pid,
                      lambda: self._do_kill(gen, ("writer", -1), writer.pid))]
        for rank, p in enumerate(readers):
            out.append(Target(self.rank_kind(rank), f"q{self.wid}.g{gen} reader r{rank}", p.pid,
                              lambda rank=rank, p=p: self._do_kill(gen, ("reader", rank), p.pid)))
        if address:
            out.append(Target("queue port", f"q{self.wid}.g{gen} publisher {address}", address=address,
                              netns=None if self.nodes is None else self.nodes.writer_ns))
        return out

    def net_targets(self) -> list[tuple[int, int]]:
        """(generation, rank) of every remote reader a network fault may hit now."""
        with self._lock:
            if self.nodes is None or self._live is None or self._fault is not None or self._stopping:
                return []
            return [(self._live[0], rank) for rank in range(self.n_local, self.n_reader)]

    def begin_fault(self, gen: int, rank: int, kind: str, seconds: float) -> NetFault | None:
        with self._lock:
            if self._live is None or self._live[0] != gen or self._fault is not None or self._stopping:
                return None
            fault = self._fault = NetFault(kind, self.wid, gen, rank, time.monotonic(), seconds)
            self._gen_faults.append(fault)
            if kind == PARTITION:  # ends the generation as a kill does
                self._live = None
                self._killed_role = ("cut", rank)
            return fault

    def end_fault(self, fault: NetFault) -> None:
        with self._lock:
            if self._fault is fault:
                self._fault = None
                self._cond.notify_all()

    def proxy_pid(self, gen: int, rank: int) -> int | None:
        with self._lock:
            return self._proxies[1].get(rank) if self._proxies[0] == gen else None

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
                while self._fault is not None and not self._stopping:  # a fault outlived its generation
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self._generation()
            except Exception as e:  # the soak's own bug: report it, do not spin
                self.report.finding("queue", f"q{self.wid}: the group's controller failed: {e!r}", zero=True)
                return

    def _generation(self):
        """One generation: start a writer and its readers, let them run until a fault or stop() ends it, collect
        their reports, account for every message and tell each network fault of the generation how it went."""
        self.gen += 1
        gen = self.gen
        with open(self.counter_path, "r+b") as f:
            f.write(b"\0" * 8)
        started = self._start_generation(gen)
        if started is None:
            return
        writer, readers, ctrl, conns, proxies, gen_pids = started
        hung, kill, role, faults = self._await_generation(writer, readers, proxies)
        w_report, r_reports, fds_left = self._collect_reports(ctrl, conns)
        with open(self.counter_path, "rb") as f:
            sent = struct.unpack("q", f.read(8))[0]
        per_rank = self._account(gen, kill, role, writer, readers, hung, w_report, r_reports, sent, faults)
        for fault in faults:
            fault.pids = gen_pids
            fault.hung = len(hung)
            fault.lost, fault.dup, fault.ooo = per_rank.get(fault.rank, (0, 0, 0))
            fault.fds_left = sum(max(0, n) for who, n in fds_left.items() if who in ("writer", fault.rank))
            fault.fds_reported = sum(1 for who in fds_left if who in ("writer", fault.rank))

    def _start_generation(self, gen: int):
        """Starts generation `gen`'s writer, its readers (behind a delay proxy where the nodes say so) and makes it
        the live one; (writer, readers, ctrl, conns, proxies, pids), or None (reported) when it did not start."""
        nodes = self.nodes
        ctrl, child = CTX.Pipe()
        writer = CTX.Process(target=_writer_main, name=f"soak-q{self.wid}-writer", daemon=True,
                             args=(self.wid, gen, self.n_reader, self.n_local, self.max_chunk, self.rate, self.seed,
                                   child, self.counter_path, LOOPBACK if nodes is None else nodes.connect_ip,
                                   None if nodes is None else nodes.writer_ns))
        writer.start()
        self.pids.add(writer.pid)
        gen_pids = {writer.pid}
        child.close()
        readers, conns, proxies = [], [], {}
        self._kill, self._killed_role, self._gen_faults = None, None, []
        try:
            msg = self._recv(ctrl, writer, START_TIMEOUT_S)
            if not msg or msg[0] != "handle":
                raise RuntimeError(f"no handle from the writer ({msg!r}, exit code {writer.exitcode})")
            handle = msg[1]
            for rank in range(self.n_reader):
                p, conn = self._start_reader(gen, rank, handle, proxies, gen_pids)
                readers.append(p)
                conns.append(conn)
            msg = self._recv(ctrl, writer, START_TIMEOUT_S)
            if not msg or msg[0] != "ready":
                raise RuntimeError(f"the writer did not report ready ({msg!r}, exit code {writer.exitcode})")
        except Exception as e:
            self.report.finding("queue", f"q{self.wid}.g{gen}: generation failed to start: {e}", zero=True)
            self.report.count("queue start failures")
            for p in [writer, *readers, *proxies.values()]:
                p.kill()
                p.join()
            for c in [ctrl, *conns]:
                c.close()
            return None
        with self._lock:
            self._ctrl = ctrl
            self._proxies = (gen, {rank: p.pid for rank, p in proxies.items()})
            if self._stopping:
                try:
                    ctrl.send("stop")
                except OSError:
                    pass
            else:
                self._live = (gen, writer, readers, ctrl, handle.remote_address)
        return writer, readers, ctrl, conns, proxies, gen_pids

    def _start_reader(self, gen: int, rank: int, handle, proxies: dict, gen_pids: set):
        """Starts reader `rank` (through a delay proxy, added to `proxies`, where the nodes say so); (process, the
        read end of its report pipe)."""
        nodes = self.nodes
        netns = None if nodes is None else nodes.reader_ns(self.wid, rank)
        rank_handle = handle
        if nodes is not None and nodes.proxied(self.wid, rank):
            proxy = self._start_proxy(netns, handle.remote_address, nodes.connect_ip)
            proxies[rank] = proxy
            gen_pids.add(proxy.pid)
            port = handle.remote_address.rsplit(":", 1)[1]
            rank_handle = dataclasses.replace(handle, remote_address=f"tcp://{LOOPBACK}:{port}")
        parent, c = CTX.Pipe(duplex=False)
        p = CTX.Process(target=_reader_main, name=f"soak-q{self.wid}-r{rank}", daemon=True,
                        args=(rank_handle, rank, self.wid, gen, c, netns))
        p.start()
        self.pids.add(p.pid)
        gen_pids.add(p.pid)
        c.close()
        return p, parent

    def _await_generation(self, writer, readers, proxies: dict):
        """Waits for the live generation to end (a kill, or the writer's end after "stop"), kills what hung, heals a
        cut node; (hung processes, the kill, its role, the generation's network faults)."""
        procs = [writer, *readers]
        mpc.wait([p.sentinel for p in procs])
        deadline = time.monotonic() + HANG_S
        hung = self._wait_all(procs, deadline)
        with self._lock:
            self._live = None
            self._ctrl = None
            self._proxies = (0, {})
            kill, role = self._kill, self._killed_role
            faults = list(self._gen_faults)
            partition = faults[-1] if role is not None and role[0] == "cut" else None
        for p in hung:
            p.kill()
            p.join()
        for p in proxies.values():  # the links' plumbing, not under test: its readers ended
            p.kill()
            p.join()
        if partition is not None:
            try:
                self.nodes.heal(self.wid, partition.rank)
            except Exception as e:
                partition.errors.append(f"healing the node failed: {e!r}")
            self.end_fault(partition)
        return hung, kill, role, faults

    @staticmethod
    def _collect_reports(ctrl, conns):
        """The final reports left in the pipes, which it closes: (the writer's, rank -> reader's, who -> descriptors
        left open)."""
        w_report, fds_left = None, {}
        while ctrl.poll():  # the handle and ready messages were read; what is left is the final report
            try:
                m = ctrl.recv()
            except (EOFError, OSError):
                break
            if m[0] == "done":
                w_report = m[1]
            elif m[0] == "closed":
                fds_left["writer"] = m[1]
        r_reports = {}
        for rank, c in enumerate(conns):
            try:
                if c.poll():
                    r_reports[rank] = c.recv()
                if c.poll():
                    fds_left[rank] = c.recv()["fds_left"]
            except (EOFError, OSError):
                pass
        for c in [ctrl, *conns]:
            c.close()
        return w_report, r_reports, fds_left

    def _start_proxy(self, netns: str, address: str, writer_ip: str):
        port = int(address.rsplit(":", 1)[1])
        parent, c = CTX.Pipe(duplex=False)
        proxy = CTX.Process(target=_proxy_main, name=f"soak-q{self.wid}-proxy", daemon=True,
                            args=(netns, port, writer_ip, c))
        proxy.start()
        self.pids.add(proxy.pid)
        c.close()
        try:
            if self._recv(parent, proxy, START_TIMEOUT_S) != "ready":
                proxy.kill()
                proxy.join()
                raise RuntimeError(f"the delay proxy did not start (exit code {proxy.exitcode})")
        finally:
            parent.close()
        return proxy

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

    def _account(self, gen, kill, role, writer, readers, hung, w_report, r_reports, sent, faults=()) -> dict:
        """Adds the generation to the totals and reports what went wrong; returns rank -> (lost, duplicated, out
        of order) of this generation."""
        tag = f"q{self.wid}.g{gen}"
        self.generations += 1
        self.sent += sent
        writer_killed = role is not None and role[0] == "writer"
        reader_killed = role[1] if role is not None and role[0] == "reader" else None
        reader_cut = role[1] if role is not None and role[0] == "cut" else None
        partition = faults[-1] if reader_cut is not None else None
        cause = "killed: " + (kill.label if kill else "nothing")
        if faults:
            cause += "; network: " + ", ".join(f.label for f in faults)
        if hung:
            self.report.count("queue processes hung", len(hung))
            self.report.finding("queue", f"{tag}: {[p.name for p in hung]} had no outcome within {HANG_S:.0f} s of "
                                         f"the generation's end ({cause})", zero=True)
        unexpected = functools.partial(self._unexpected, tag, cause, faults)
        if not writer_killed and writer not in hung:
            self._check_writer(unexpected, writer, w_report, sent, kill, partition, reader_killed, reader_cut)
        per_rank = {}
        killed = readers[reader_killed] if reader_killed is not None else None
        for rank, p in enumerate(readers):
            if rank == reader_killed or p in hung:
                continue
            r = r_reports.get(rank)
            if r is None:
                unexpected(f"reader r{rank} exited (code {p.exitcode}) without a report")
                continue
            # remote readers of one queue share a node, and so a relay (node_id(): the soak sets no HOTLOOP_NODE_ID)
            killed_on_its_node = killed is not None and min(rank, reader_killed) >= self.n_local
            relay_killed = _lost_its_relay(r, killed, killed_on_its_node)
            if writer_killed:
                if r["end"] == "dead_peer":
                    kill.detected_s.append(r["t"] - kill.t)
                else:
                    unexpected(f"reader r{rank} ended with {r['end']} after its writer was killed: {r['error']}")
            elif relay_killed:
                pass  # documented: a dead relay is a dead peer for every rank behind it (queue/relay.py)
            elif rank == reader_cut:
                if r["end"] == "dead_peer":
                    partition.detected_s["reader"] = r["t"] - partition.t
                else:
                    unexpected(f"reader r{rank} ended with {r['end']} after its node was cut off: {r['error']}")
            elif r["end"] != "closed":
                unexpected(f"reader r{rank} ended with {r['end']}: {r['error']}")
            per_rank[rank] = self._count_reader(tag, cause, rank, r, sent, writer_killed, reader_cut, relay_killed)
        for p in [writer, *readers]:
            killed = (p is writer and writer_killed) or (reader_killed is not None and p is readers[reader_killed])
            if not killed and p not in hung and p.exitcode not in (0, None):
                unexpected(f"{p.name} exited with code {p.exitcode}")
        return per_rank

    def _unexpected(self, tag: str, cause: str, faults, what: str) -> None:
        """Reports an outcome the generation's faults do not explain, and gives it to each of them."""
        self.report.count("queue unexpected errors")
        self.report.finding("queue", f"{tag}: {what} ({cause})", zero=True)
        for f in faults:
            f.errors.append(what)

    @staticmethod
    def _check_writer(unexpected, writer, w_report, sent, kill, partition, reader_killed, reader_cut) -> None:
        """Checks the surviving writer's outcome against the generation's kill or cut."""
        if w_report is None:
            unexpected(f"the writer exited (code {writer.exitcode}) without a report")
        elif w_report["end"] == "dead_peer":
            if reader_cut is not None:
                if f"rank {reader_cut}" not in w_report["error"]:
                    unexpected(f"the writer's DeadPeerError names another rank than r{reader_cut}, whose node was "
                               f"cut off: {w_report['error']}")
                else:
                    partition.detected_s["writer"] = w_report["t"] - partition.t
            elif reader_killed is None:
                unexpected(f"the writer got DeadPeerError with no reader killed: {w_report['error']}")
            else:
                kill.detected_s.append(w_report["t"] - kill.t)
        elif w_report["end"] != "stopped":
            unexpected(f"the writer ended with {w_report['end']}: {w_report['error']}")
        elif kill is not None and reader_killed is not None:
            kill.note = "the run ended before the writer noticed"
        elif partition is not None:
            partition.note = "the run ended before the writer noticed"
        if w_report is not None and w_report["sent"] != sent:
            unexpected(f"the writer reports {w_report['sent']} sent, its counter {sent}")

    def _count_reader(self, tag, cause, rank, r, sent, writer_killed, reader_cut,
                      relay_killed=False) -> tuple[int, int, int]:
        """Adds a surviving reader's report to its rank's totals and reports its losses; (lost, duplicated, out of
        order)."""
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
        elif tail > 0 and relay_killed:
            t.inflight_at_relay_kill += tail
        elif tail > 0 and rank == reader_cut:
            t.cut_off_tail += tail
        elif tail > 0:
            lost += tail
        t.lost += lost
        for what, n in (("lost", lost), ("duplicated", r["dup"]), ("out of order", r["ooo"]),
                        ("corrupt or foreign", r["bad"] + r["foreign"])):
            if n:
                self.report.finding("queue", f"{tag}: reader r{rank} ({self.rank_kind(rank)}): {n} message(s) "
                                             f"{what} of {sent} sent (received {r['received']}, last seq "
                                             f"{r['max_seq']}, {cause})", zero=True)
        return lost, r["dup"], r["ooo"]
