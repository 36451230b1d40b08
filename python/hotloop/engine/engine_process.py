"""The engine process: EngineCore on its main thread, an input thread and an output thread around it.

Contract: the client binds two ZeroMQ sockets (requests PUSH, outputs PULL) and starts ``engine_main`` in a new
process, which connects to them. The input thread receives, decodes (msgspec), stamps ``arrival_ns`` and puts each
message on the core's InputQueue (waking the core wherever it waits); the output thread parks on the core's output
InputQueue, drains it, encodes and sends one batch per wake. A message that does not decode (a field of the wrong
type, corrupt bytes) hurts nothing else: if it is an AddRequest whose request id can still be read (decoded
leniently, as plain msgpack), that request is answered with an "error" output naming the bad field; otherwise
it is logged and dropped. Values that decode but are out of range are the core's to reject (also an "error").
The engine exits when its parent dies (kernel parent-death signal), on ShutdownRequest, or when its executor
fails (after sending every request its error).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import traceback

import msgspec
import zmq

from hotloop._core import ClosedError, InputQueue
from hotloop.engine.core import EngineCore
from hotloop.errors import ExecutorError
from hotloop.stage_process.lifecycle import die_with_parent
from hotloop.stage_process.stage import connect_to_client
from hotloop.engine.protocol import (AddRequest, FinishReason, OutputBatch, RequestOutput, ShutdownRequest, StatsReport,
                                     client_decoder, encoder)

_ADD_FIELDS = AddRequest.__struct_fields__
_ADD_TAG = AddRequest.__struct_config__.tag


def _undecodable_add(data: bytes, error: Exception) -> RequestOutput | None:
    """The error answer to an AddRequest that failed to decode, if its request id can be read; else None."""
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:
        return None
    if not (isinstance(obj, list) and len(obj) > 1 and obj[0] == _ADD_TAG and isinstance(obj[1], str)):
        return None
    rid = obj[1]
    why = str(error)
    m = re.match(r".* - at `\$\[(\d+)\]", why)  # array_like: index 0 is the tag, then the fields in order
    if m and 0 < int(m.group(1)) <= len(_ADD_FIELDS):
        why = f"{_ADD_FIELDS[int(m.group(1)) - 1]}: {why}"
    return RequestOutput(rid, [], True, FinishReason.ERROR, f"request {rid!r}: the engine could not decode it ({why}); send "
                                                  "the fields with the types of hotloop.engine.protocol.AddRequest")


def _input_thread(sock: zmq.Socket, inputs: InputQueue, outputs: InputQueue):
    while True:
        try:
            data = sock.recv()
        except zmq.ContextTerminated:
            return
        try:
            msg = client_decoder.decode(data)
        except Exception as e:  # a corrupt message fails nothing else; its sender is told when it can be named
            answer = _undecodable_add(data, e)
            if answer is None:
                print(f"hotloop engine: dropped an undecodable client message: {e}", flush=True)
                continue
            try:
                outputs.put([answer])
            except ClosedError:
                return
            continue
        if isinstance(msg, AddRequest):
            msg.arrival_ns = time.monotonic_ns()
        try:
            inputs.put(msg)
        except ClosedError:
            return
        if isinstance(msg, ShutdownRequest):
            return


def _encode_batch(batch: list[RequestOutput]) -> bytes | None:
    """One OutputBatch; an output that cannot be encoded is logged and left out (the others still go)."""
    try:
        return encoder.encode(OutputBatch(batch))
    except Exception:
        kept = []
        for out in batch:
            try:
                encoder.encode(out)
                kept.append(out)
            except Exception as e:
                print(f"hotloop engine: dropped an output that cannot be encoded ({e}): {out!r:.200}", flush=True)
        return encoder.encode(OutputBatch(kept)) if kept else None


def _output_thread(sock: zmq.Socket, outputs: InputQueue):
    while True:
        try:
            items = [outputs.get()]
        except ClosedError:
            return
        items += outputs.drain()
        batch: list[RequestOutput] = []
        for item in items:
            if isinstance(item, StatsReport):
                if batch:
                    data = _encode_batch(batch)
                    if data is not None:
                        sock.send(data)
                    batch = []
                sock.send(encoder.encode(item))
            else:
                batch.extend(item)
        if batch:
            data = _encode_batch(batch)
            if data is not None:
                sock.send(data)


def engine_main(input_addr: str, output_addr: str, engine_kwargs: dict, parent_pid: int, ready_conn) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client owns Ctrl-C; it shuts the engine down
    try:
        outputs = InputQueue()
        core = EngineCore(**engine_kwargs, output_queue=outputs)
    except BaseException as e:
        ready_conn.send(f"engine start-up failed: {e!r}")
        raise
    in_sock, out_sock = connect_to_client(input_addr, output_addr)
    threading.Thread(target=_input_thread, args=(in_sock, core.input_queue, outputs), name="hotloop-engine-input",
                     daemon=True).start()
    sender = threading.Thread(target=_output_thread, args=(out_sock, outputs), name="hotloop-engine-output",
                              daemon=True)
    sender.start()
    ready_conn.send(os.getpid())
    ready_conn.close()
    code = 0
    try:
        core.run()
    except ExecutorError as e:
        print(f"hotloop engine: stopping: {e}", flush=True)
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    outputs.close()  # the output thread sends what is queued, then exits
    sender.join(5)
    out_sock.close()
    os._exit(code)  # the input thread is blocked in recv; nothing else to clean up
