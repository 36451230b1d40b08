"""The soak's chaos: seeded SIGKILLs, SIGSTOPs and garbage aimed at the loads' processes and queue ports.

Contract:

- A load offers ``Target``s (``targets()``): a process with a ``kill`` callable, or a queue publisher's address.
  ``Chaos.run(until)`` runs on the soak's event loop: every ~``mean_interval_s`` (exponential, at least 0.3 s)
  it picks a target kind at random, then a target, and SIGKILLs it (recorded as a ``Kill``: the load fills in
  ``detected_s`` when its survivors raise their errors), or SIGSTOPs it for 0.1-2 s and SIGCONTs it (only if its
  pid still names the same process), or sends garbage to a queue port.
- ``send_garbage`` connects to a publisher as a stranger (raw TCP bytes, then ZeroMQ sockets of several types
  with random frames) and closes everything before it returns; it refuses any host but loopback, unless it runs
  on a simulated node (``hotloop soak --network``: a spawned process joins the publisher's node first, so the
  junk still never leaves the machine).
- The driver may sleep between chaos events; nothing here is on a data path.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import time
from dataclasses import dataclass

from hotloop.soak.findings import Findings, Kill
from hotloop.soak.own_processes import CTX, LOOPBACK, die_with_parent, log, start_time, send_signal


@dataclass
class Target:
    kind: str
    label: str
    pid: int = 0
    kill: object = None  # callable(): SIGKILL it (and record the Kill); None: not killable
    address: str | None = None  # a queue publisher's tcp://ip:port: garbage goes there
    netns: str | None = None  # the simulated node the publisher is on (None: loopback)


class Chaos:
    """Seeded: every ~mean_interval_s, one action on one random target: SIGKILL, SIGSTOP for 0.1-2 s then SIGCONT,
    or garbage sent to a queue's publisher port."""

    def __init__(self, rng: random.Random, components: list, report: Findings, mean_interval_s: float = 3.0):
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
                    log(f"chaos: SIGKILL {target.label} (pid {target.pid})")
            else:
                await self._stop(target, rng.uniform(0.1, 2.0))

    async def _stop(self, target: Target, seconds: float):
        start = start_time(target.pid)
        if start is None:
            return
        if not send_signal(target.pid, signal.SIGSTOP):
            return
        self._did(f"stop {target.kind}")
        log(f"chaos: SIGSTOP {target.label} (pid {target.pid}) for {seconds:.2f} s")
        try:
            await asyncio.sleep(seconds)
        finally:
            if start_time(target.pid) == start:  # not a reused pid (send_signal checks it is ours too)
                send_signal(target.pid, signal.SIGCONT)

    async def _garbage(self, target: Target):
        seed = self.rng.randrange(1 << 30)
        self._did("garbage to a queue port")
        log(f"chaos: garbage to {target.label}")
        try:
            if target.netns is None:
                await asyncio.to_thread(send_garbage, target.address, seed)
            else:
                await asyncio.to_thread(_garbage_from_node, target.netns, target.address, seed)
        except Exception as e:
            self.report.finding("chaos", f"sending garbage to {target.address} failed in the soak: {e!r}")


def _garbage_from_node(netns: str, address: str, seed: int) -> None:
    """send_garbage from a process on the publisher's simulated node (the soak's own namespace cannot reach it)."""
    p = CTX.Process(target=_garbage_main, args=(netns, address, seed), name="soak-garbage", daemon=True)
    p.start()
    p.join(60)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise RuntimeError("sending garbage from the node took over 60 s")
    if p.exitcode != 0:
        raise RuntimeError(f"sending garbage from the node failed (exit code {p.exitcode})")


def _garbage_main(netns: str, address: str, seed: int) -> None:
    die_with_parent()
    from hotloop.testing.netns import join

    join(netns)
    send_garbage(address, seed, on_node=True)


def send_garbage(address: str, seed: int, on_node: bool = False) -> None:
    """Connect to a queue's publisher as a stranger and send junk: raw TCP bytes, then ZeroMQ sockets of several
    types with random frames (subscriptions, unsubscriptions, bytes). Everything is closed before returning.
    on_node: this process is on a simulated node, where any address stays on the machine."""
    import zmq

    rng = random.Random(seed)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    if host != LOOPBACK and not on_node:
        raise ValueError(f"garbage must stay on loopback (or a simulated node), not {host}")
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
