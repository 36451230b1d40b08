"""A stage process: the engine process, or any other stage of a pipeline (the orchestrator's transform stage),
started by its client and talked to over two ZeroMQ sockets (requests out, outputs in), msgpack-encoded. Every
stage takes the messages of stage_process/messages.py (abort, shut down) beside its own.

Contract (client side, ``StageProcess``): binds the outputs socket (PULL) in a private directory, starts
``target(in_addr, out_addr, kwargs, parent_pid, ready_conn)`` in a spawned process and waits for it to send its
pid on ``ready_conn`` (a str instead: why it cannot start; EngineDeadError either way, naming it), then connects
the requests socket (PUSH) to the stage's bound input. ``send`` never blocks. The process sentinel
(``proc.sentinel``) tells its death; ``death_message()`` says how it ended. ``stop()`` asks it to shut down, then
escalates (SIGTERM, SIGKILL: stage_process.lifecycle) and reaps it, and removes the socket files.

Stage side: ``connect_to_client(in_addr, out_addr)`` gives the stage its two sockets; the stage calls
``die_with_parent`` (stage_process.lifecycle) first, so it never outlives its client.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import tempfile

import zmq
import zmq.asyncio

from hotloop.errors import EngineDeadError
from hotloop.stage_process.lifecycle import stop_processes
from hotloop.stage_process.messages import AbortRequest, ShutdownRequest, encoder

CTX = mp.get_context("spawn")


class StageProcess:
    """Starts a stage process and owns the client's end of its sockets (the module's contract)."""

    def __init__(self, ctx: zmq.Context, target, kwargs: dict, start_timeout: float, name: str,
                 async_outputs: bool = False):
        """Start `target(in_addr, out_addr, kwargs, parent_pid, ready_conn)` in a new process, named `name`, and
        wait up to `start_timeout` s for it to send its pid on ready_conn (or a str saying why it cannot start)."""
        self._dir = tempfile.mkdtemp(prefix=name + "-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.ctx = ctx
        # Requests: the process binds, this side connects once it is ready, so the pipe exists from then on and a
        # send never blocks (a bound PUSH with no peer would block, and an event loop with it).
        self.requests = ctx.socket(zmq.PUSH)
        self.requests.setsockopt(zmq.LINGER, 0)
        self.requests.setsockopt(zmq.SNDHWM, 0)
        # async_outputs: an asyncio socket that owns its handle (a shadow of a sync socket would leave the sync
        # object to close the handle a second time when it is collected)
        out_ctx = zmq.asyncio.Context.shadow(ctx.underlying) if async_outputs else ctx
        self.outputs = out_ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(out_addr)
        parent, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, name=name, daemon=False,
                                args=(in_addr, out_addr, kwargs, os.getpid(), child))
        self.proc.start()
        child.close()
        try:
            ready = mpc.wait([parent, self.proc.sentinel], timeout=start_timeout)
            msg = parent.recv() if parent in ready else None
        except EOFError:
            msg = None
        finally:
            parent.close()
        if not isinstance(msg, int):
            self.stop(graceful=False)
            why = msg or f"exit code {self.proc.exitcode}" if self.proc.exitcode is not None else "no answer"
            raise EngineDeadError(f"the {name} process did not start ({why}); see its output above")
        self.requests.connect(in_addr)
        self.pid = msg
        self.dead = False
        self.dead_reason: str | None = None  # what the stage said when it stopped serving (its executor failed)

    def send(self, msg) -> None:
        """Never blocks: a PUSH socket whose peer is gone would wait forever (and an event loop with it)."""
        try:
            self.requests.send(encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # not expected with an unlimited queue; never block instead
            raise EngineDeadError(f"the {self.proc.name} process (pid {self.proc.pid}) does not take requests; "
                                  "nothing sent to it will be answered") from None

    def abort_quietly(self, request_id: str) -> None:
        """Abort a request a caller left; nothing to do if the process is gone."""
        if not self.dead:
            try:
                self.send(AbortRequest([request_id]))
            except EngineDeadError:
                pass

    def death_message(self) -> str:
        if self.dead_reason:
            return self.dead_reason
        code = self.proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"the {self.proc.name} process (pid {self.proc.pid}) {how}"

    def stop(self, graceful: bool = True, close_outputs: bool = True) -> None:
        """Stop and reap the process. close_outputs=False: the caller closed the outputs socket itself (an
        asyncio socket shadowing it must be closed through the shadow, which also unhooks it from the loop)."""
        if graceful and self.proc.exitcode is None:
            try:
                self.send(ShutdownRequest())
            except (zmq.ZMQError, EngineDeadError):
                pass
        stop_processes([self.proc], grace_s=5 if graceful else 0, term_s=2)
        self.requests.close(0)
        if close_outputs:
            self.outputs.close(0)
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except FileNotFoundError:
                pass
        os.rmdir(self._dir)


def connect_to_client(input_addr: str, output_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A stage process's two sockets: PULL for the client's requests (bound here; the client connects once the
    process reports ready), PUSH to its outputs (the client bound it). The output socket lingers 2 s at close so
    the last outputs reach the client."""
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.bind(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(output_addr)
    return in_sock, out_sock
