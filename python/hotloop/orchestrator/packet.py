"""Packet: one piece of a request's output, as a stage's replica produces it and as the orchestrator streams it to
its caller: an LLM stage's new tokens or a transform stage's float32 frames; the last one has ``finished`` and a
``FinishReason`` (``error`` says why for ERROR and ENGINE_DEAD; the orchestrator raises it to the caller
instead of streaming it)."""

from __future__ import annotations

from dataclasses import dataclass

from hotloop.engine.protocol import FinishReason


@dataclass
class Packet:
    request_id: str
    tokens: list[int] | None = None  # an LLM stage's new tokens
    frames: bytes | None = None  # a transform stage's float32 samples
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
