"""Messages between engine clients and the engine process (msgspec structs, encoded as msgpack on ZeroMQ).

Client -> engine: ``AddRequest``, ``AbortRequest``. Engine -> client: lists of ``RequestOutput`` (each one's newly
generated tokens; ``finished`` with a reason: "stop", "length", "abort" or "error" with ``error`` set).
``arrival_ns`` is stamped by the engine's input thread (time.monotonic_ns) when it receives the request.
"""

from __future__ import annotations

import msgspec


class AddRequest(msgspec.Struct, array_like=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: list[int] = []
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    arrival_ns: int = 0


class AbortRequest(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class RequestOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


ClientMessage = AddRequest | AbortRequest

encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
outputs_decoder = msgspec.msgpack.Decoder(list[RequestOutput])
