"""Fuzz the engine protocol decoders (hotloop.engine.protocol): every msgspec msgpack Decoder the module defines
(client_decoder in the engine process, engine_decoder in clients; found by type, so new ones are fuzzed too).

Contract checked: for any bytes, each decoder returns one of the message types of its union or raises
msgspec.DecodeError (msgspec.ValidationError is one); never another exception, a crash, a hang (libFuzzer
-timeout) or a peak RSS growing by more than 256 MiB.

Input: first byte even = the rest is fed as is (the saved corpus holds valid encodings of every message type);
odd = the rest drives a generator of msgpack values (arrays led by the message tags, ints at the 64-bit edges,
strings, nested containers) that is encoded and fed to every decoder.

Long run:  python tests/fuzz/fuzz_protocol.py -max_total_time=600 tests/fuzz/corpus/protocol
"""

from __future__ import annotations

import typing

import atheris
import msgspec

import _common

from hotloop.engine import protocol

DECODERS = {name: d for name, d in vars(protocol).items() if isinstance(d, msgspec.msgpack.Decoder)}
RSS_GROWTH_MB = 256


def _message_types(decoder) -> tuple:
    t = decoder.type
    args = typing.get_args(t)
    return args if args else (t,)


TYPES = {name: _message_types(d) for name, d in DECODERS.items()}
TAGS = sorted({msgspec.inspect.type_info(t).tag for ts in TYPES.values() for t in ts
               if isinstance(msgspec.inspect.type_info(t), msgspec.inspect.StructType)
               and msgspec.inspect.type_info(t).tag is not None}, key=str)
INTS = [0, 1, -1, 127, 128, 255, 256, -32, -33, 2**31 - 1, 2**31, -2**31, 2**32, 2**53, 2**63 - 1, -2**63,
        2**64 - 1]


def gen_value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 11)
    if depth > 6:
        kind %= 6
    if kind == 0:
        return INTS[fdp.ConsumeIntInRange(0, len(INTS) - 1)]
    if kind == 1:
        return fdp.ConsumeIntInRange(-2**63, 2**64 - 1)
    if kind == 2:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 20))
    if kind == 3:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 20))
    if kind == 4:
        return fdp.PickValueInList([None, True, False, 0.0, -1.5, float("inf"), float("nan"), 1e308])
    if kind == 5:
        return fdp.ConsumeRegularFloat()
    if kind in (6, 7, 8):  # a message-shaped array: a tag, then fields
        items = [gen_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 9))]
        return [fdp.PickValueInList(TAGS) if TAGS else "", *items]
    if kind == 9:
        return [gen_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 6))]
    if kind == 10:
        n = fdp.ConsumeIntInRange(0, 4)
        return {str(gen_value(fdp, depth + 1))[:10]: gen_value(fdp, depth + 1) for _ in range(n)}
    return msgspec.msgpack.Ext(fdp.ConsumeIntInRange(-128, 127), fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8)))


def message_from_input(data: bytes) -> bytes:
    if not data or data[0] % 2 == 0:
        return data[1:]
    fdp = atheris.FuzzedDataProvider(data[1:])
    value = gen_value(fdp)
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError, ValueError):  # e.g. an int past 64 bits: nothing to decode
        return b""


_baseline_rss = None


def check(buf: bytes) -> None:
    global _baseline_rss
    if _baseline_rss is None:
        _baseline_rss = _common.peak_rss_mb()
    for name, decoder in DECODERS.items():
        try:
            msg = decoder.decode(buf)
        except msgspec.DecodeError:
            continue
        except Exception as e:
            raise _common.Finding(f"protocol.{name}.decode raised {type(e).__name__}, not msgspec.DecodeError: "
                                  f"{e!r}; input {buf.hex()}") from e
        if not isinstance(msg, TYPES[name]):
            raise _common.Finding(f"protocol.{name}.decode returned {type(msg).__name__}, not one of {TYPES[name]}")
    grown = _common.peak_rss_mb() - _baseline_rss
    if grown > RSS_GROWTH_MB:
        raise _common.Finding(f"peak RSS grew by {grown} MiB decoding {len(buf)} bytes")


def TestOneInput(data: bytes) -> None:
    check(message_from_input(data))


# Coverage for libFuzzer (the decoders are C): the generator's and the checker's own branches.
for _fn in (gen_value, message_from_input, check):
    atheris.instrument_func(_fn)


if __name__ == "__main__":
    _common.run_atheris(TestOneInput)
