"""The messages every stage process understands, whatever else it serves (msgspec structs, msgpack on ZeroMQ).

Contract: ``AbortRequest(request_ids)`` ends those requests: the stage drops their work and answers each one it
holds with a finished "abort" output; ``ShutdownRequest()`` stops the stage. ``StageProcess`` (stage_process/stage.py) sends both with ``encoder``, so a
stage's input decoder must take ``StageMessage`` in its tagged union beside its own messages (the engine's
``ClientMessage``, the transform stage's ``TransformInput``), whose tags must differ from "abort" and "shutdown".
Structs are array-like (a tag, then the fields in order) and do not check their fields when built.
"""

from __future__ import annotations

import msgspec


class AbortRequest(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class ShutdownRequest(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


StageMessage = AbortRequest | ShutdownRequest

encoder = msgspec.msgpack.Encoder()  # stateless: one for every message of every stage
