"""Byte-level tokenizer: token ids 0..255 are the bytes of UTF-8 text; BOS and EOS follow. Needs no vocabulary file.

``encode(text)`` prepends BOS; ``decode(ids)`` drops special ids and replaces invalid UTF-8 (a streamed chunk may
end inside a character, so streaming callers decode the whole output so far, or use ``decode_bytes``)."""

from __future__ import annotations

BOS = 256
EOS = 257
VOCAB_SIZE = 258


def encode(text: str, bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode_bytes(ids) -> bytes:
    return bytes(i for i in ids if 0 <= i < 256)


def decode(ids) -> str:
    return decode_bytes(ids).decode("utf-8", errors="replace")
