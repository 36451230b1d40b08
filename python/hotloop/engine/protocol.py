"""Messages between engine clients and the engine process (msgspec structs, encoded as msgpack on ZeroMQ).

Client -> engine: ``AddRequest``, ``AbortRequest``, ``StatsRequest``, ``ShutdownRequest``. Engine -> client:
``OutputBatch`` (RequestOutputs: each one's newly generated tokens; ``finished`` with a ``FinishReason``; ``error``
set for ERROR and ENGINE_DEAD) and ``StatsReport``. ``AbortRequest``, ``ShutdownRequest`` and ``encoder`` are every
stage process's (hotloop.stage_process.messages), re-exported here; ``client_decoder`` takes them with the engine's own.
``arrival_ns`` is stamped by the engine's input thread (time.monotonic_ns) when it receives the request.
Structs do not check their fields when built: the clients check an AddRequest before sending it and the engine
checks it again (``scheduler.check_request``: a str id, int token ids in the vocabulary, max_tokens >= 1, a finite
temperature >= 0, where a temperature below 1e-5 is greedy like 0, a 64-bit seed, a bool ignore_eos).
"""

from __future__ import annotations

import enum

import msgspec

from hotloop.stage_process.messages import AbortRequest, ShutdownRequest, encoder  # noqa: F401  (re-exported)


class FinishReason(str, enum.Enum):
    """Why a request ended (a str: FinishReason.STOP == "stop"; sent as its value)."""

    STOP = "stop"  # EOS or one of its stop ids
    LENGTH = "length"  # max_tokens
    ABORT = "abort"  # aborted by its client
    ERROR = "error"  # this request failed alone (a bad field, a failed draw): ``error`` says why
    ENGINE_DEAD = "engine_dead"  # the engine cannot run steps any more: every request ends with it


class AddRequest(msgspec.Struct, array_like=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: list[int] = []
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    arrival_ns: int = 0


class StatsRequest(msgspec.Struct, array_like=True, tag="stats?"):
    """Ask the engine for its counters (answered with a StatsReport on the output stream)."""


class RequestOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None


class OutputBatch(msgspec.Struct, array_like=True, tag="out"):
    outputs: list[RequestOutput]


class StatsReport(msgspec.Struct, array_like=True, tag="stats"):
    steps: int
    queue_wait_ns: list[int]  # input thread receive -> scheduler, per request since the last report
    added_during_step: int
    wait_mode: str


ClientMessage = AddRequest | AbortRequest | StatsRequest | ShutdownRequest
EngineMessage = OutputBatch | StatsReport

client_decoder = msgspec.msgpack.Decoder(ClientMessage)
engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
