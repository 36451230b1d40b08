"""The transform stage: a small torch "vocoder" that turns chunks of tokens into float audio frames, in its own
process, served like an engine (requests in, output batches out, over ZeroMQ).

Contract: ``TransformChunk(request_id, token_ids, final)`` in; for each chunk one ``TransformOutput`` with
``HOP`` float32 samples per token (``finished`` on the final chunk). ``AbortRequest`` forgets a request (a chunk
that arrives for it later is dropped); ``ShutdownRequest`` stops the process; a message that does not decode is logged and dropped. Weights are seeded, so the same
tokens give the same frames. The process dies with its parent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

import msgspec

from hotloop.engine.protocol import FinishReason
from hotloop.stage_process.lifecycle import die_with_parent
from hotloop.stage_process.messages import AbortRequest, ShutdownRequest, StageMessage, encoder
from hotloop.stage_process.stage import connect_to_client

log = logging.getLogger("hotloop.orchestrator.vocoder")

HOP = 80  # samples per token: 5 ms of audio at 16 kHz
SAMPLE_RATE = 16000


class TransformChunk(msgspec.Struct, array_like=True, tag="chunk"):
    request_id: str
    token_ids: list[int]
    final: bool = False


class TransformOutput(msgspec.Struct, array_like=True):
    request_id: str
    frames: bytes  # float32 samples
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None


class TransformBatch(msgspec.Struct, array_like=True, tag="tout"):
    outputs: list[TransformOutput]


TransformInput = TransformChunk | StageMessage  # its own chunks, and the abort and shutdown every stage takes
input_decoder = msgspec.msgpack.Decoder(TransformInput)
output_decoder = msgspec.msgpack.Decoder(TransformBatch)


class Vocoder:
    def __init__(self, vocab: int = 258, dim: int = 64, seed: int = 1):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, dim, generator=g)
        self.w = torch.randn(dim, HOP, generator=g) / dim ** 0.5

    def __call__(self, token_ids: list[int]) -> bytes:
        import torch

        with torch.inference_mode():
            x = torch.tanh(self.embed[torch.tensor(token_ids, dtype=torch.long)] @ self.w)
        x = x.reshape(-1).to(torch.float32).contiguous()
        # the samples' bytes, copied once; not through .numpy(): numpy is not a dependency of hotloop (nor of torch)
        return ctypes.string_at(x.data_ptr(), x.numel() * x.element_size())


def transform_main(in_addr: str, out_addr: str, kwargs: dict, parent_pid: int, ready_conn) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        vocoder = Vocoder(**kwargs)
    except BaseException as e:  # the stage's start fails naming why (StageProcess raises EngineDeadError with it)
        ready_conn.send(f"vocoder start-up failed: {e!r}")
        raise
    inp, out = connect_to_client(in_addr, out_addr)
    ready_conn.send(os.getpid())
    ready_conn.close()
    aborted: set[str] = set()
    while True:
        raw = inp.recv()  # one blocking receive per message: no polling
        try:
            msg = input_decoder.decode(raw)
        except msgspec.DecodeError as e:  # a malformed message is dropped; the process serves on
            log.warning("transform stage: dropped an undecodable message of %d bytes (%s)", len(raw), e)
            continue
        if isinstance(msg, ShutdownRequest):
            break
        if isinstance(msg, AbortRequest):
            aborted.update(msg.request_ids)
            out.send(encoder.encode(TransformBatch([TransformOutput(r, b"", True, FinishReason.ABORT) for r in msg.request_ids])))
            continue
        if msg.request_id in aborted:
            continue
        try:
            frames = vocoder(msg.token_ids) if msg.token_ids else b""
            res = TransformOutput(msg.request_id, frames, msg.final, FinishReason.STOP if msg.final else None)
        except Exception as e:  # a bad chunk fails its request only
            res = TransformOutput(msg.request_id, b"", True, FinishReason.ERROR, f"transform failed: {e!r}")
        out.send(encoder.encode(TransformBatch([res])))
    out.close()
    os._exit(0)
