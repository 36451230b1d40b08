"""A TCP proxy that delays every byte it forwards, for tests of remote queues over a slow link (this kernel has no
``netem``: delay and jitter are added in user space).

``python -m hotloop.testing.delay_proxy LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS JITTER_MS
[CONNECTIONS] [--switched]`` accepts connections on the listen address and connects each to the target. Each chunk
read from either side is written to the other ``DELAY_MS +- JITTER_MS`` (uniform) after it was read, never before
the chunk read before it (a TCP stream keeps its order, so jitter spreads the chunks' delays without reordering
them). A side that closes closes the other once what it sent was delivered. Prints ``ready`` on stdout once
listening; runs until killed, or, given CONNECTIONS, exits once that many connections have ended (everything they
carried delivered).
``--switched``: the delay starts off; SIGUSR1 turns it on, SIGUSR2 off (a fault that comes and goes on a link
already in use). A chunk is never sent before the one read before it, so switching reorders nothing.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time


class Delay:
    """What a proxy adds to each chunk: ``delay_ms +- jitter_ms`` while on, nothing while off."""

    def __init__(self, delay_ms: float, jitter_ms: float, on: bool = True):
        self.delay, self.jitter, self.on = delay_ms / 1000.0, jitter_ms / 1000.0, on

    def draw(self) -> float:
        return self.delay + random.uniform(-self.jitter, self.jitter) if self.on else 0.0


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    """Forward reader -> writer, each chunk delayed, in order."""
    due_queue: asyncio.Queue = asyncio.Queue()

    async def deliver():
        while True:
            due, chunk = await due_queue.get()
            if chunk is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    last_due = 0.0
    try:
        while chunk := await reader.read(1 << 16):
            last_due = max(last_due, time.monotonic() + delay.draw())
            due_queue.put_nowait((last_due, chunk))
    except ConnectionError:
        pass
    finally:
        due_queue.put_nowait((0.0, None))
        try:
            await sender
        except ConnectionError:
            pass


async def serve(listen_host: str, listen_port: int, target_host: str, target_port: int, delay_ms: float,
                jitter_ms: float, connections: int | None = None, switched: bool = False, ready=None) -> None:
    """Proxy until ``connections`` connections ended (None: forever); ``ready()`` is called once listening
    (default: print ``ready``)."""
    delay = Delay(delay_ms, jitter_ms, on=not switched)
    if switched:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, setattr, delay, "on", True)
        loop.add_signal_handler(signal.SIGUSR2, setattr, delay, "on", False)
    ended, done = 0, asyncio.Event()

    async def on_client(client_r, client_w):
        nonlocal ended
        try:
            try:
                target_r, target_w = await asyncio.open_connection(target_host, target_port)
            except OSError:
                client_w.close()
            else:
                await asyncio.gather(_pump(client_r, target_w, delay), _pump(target_r, client_w, delay))
        except asyncio.CancelledError:  # the proxy is ending (CONNECTIONS ended): a connection still open goes
            return                      # with it, quietly
        ended += 1
        if connections is not None and ended >= connections:
            done.set()

    server = await asyncio.start_server(on_client, listen_host, listen_port)
    if ready is None:
        print("ready", flush=True)
    else:
        ready()
    async with server:
        await done.wait()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--switched"]
    host, port, thost, tport, delay_ms, jitter_ms = args[:6]
    asyncio.run(serve(host, int(port), thost, int(tport), float(delay_ms), float(jitter_ms),
                      int(args[6]) if len(args) > 6 else None, switched="--switched" in sys.argv[1:]))
