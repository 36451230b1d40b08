"""Write the saved seed corpus of each fuzz target under tests/fuzz/corpus/<target>/ (small files, named by content).

    python tests/fuzz/make_corpus.py [target ...]      # default: every target; an existing directory is replaced

Each file is one input of that target's TestOneInput (see the harness docstrings for the input formats).
Reproducers of fixed findings are regression seeds here; those of known, unfixed findings live in
tests/fuzz/known/<target>/ (written by hand from the run's crash files, not by this script).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def serialization_inputs() -> list[bytes]:
    import fuzz_serialization as f

    out = [b"\x00" + seed for seed in f.SEEDS]  # valid messages, as is
    for i in range(len(f.SEEDS)):  # each seed with a short mutation program (set byte, truncate, plant a length)
        out.append(b"\x01" + bytes([i]) + bytes([i % 6, 4 + i, 0, i, 0, 0, 0]))
    head = struct.Struct("<4sII")
    out += [
        b"\x00",  # empty message
        b"\x00HLM1",  # shorter than a header
        b"\x00" + head.pack(b"HLM2", 0, 1) + b"N",  # bad magic
        b"\x00" + head.pack(b"HLM1", 0, 3) + b"\x80\x05N",  # no STOP
        b"\x00" + head.pack(b"HLM1", 0, 4) + b"\x80\x05N.",  # a pickle without buffers behind a header (valid)
        b"\x00\x80\x05N",  # a bare pickle without STOP
        b"\x00" + head.pack(b"HLM1", 0xFFFFFFFF, 0),  # fixed: struct.error from a huge buffer count
        b"\x00" + head.pack(b"HLM1", 2, 0) + b"\0" * 8,  # fixed: struct.error, buffer lengths cut short
        b"\x00" + head.pack(b"HLM1", 1, 0xFFFFFFFF) + struct.pack("<Q", 0),
        b"\x00" + head.pack(b"HLM1", 1, 4) + struct.pack("<Q", (1 << 64) - 1) + b"\x80\x05N.",
    ]
    # fixed: an empty-tensor encoding whose shape was changed made _rebuild_tensor allocate it (torch.empty)
    empty = bytearray(f.encode(f.seed_objects()[18]))  # torch.empty(0, 3)
    k = empty.index(b"K\x00K\x03")
    big = bytearray(empty[:k] + b"J\x00\x00\x00\x40K\x03" + empty[k + 4:])  # shape (2**30, 3): 12 GiB
    frame = 2  # the pickle's FRAME opcode and its 8-byte length (a bare pickle: no out-of-band buffers)
    if big[:4] == f.serialization.MAGIC:
        n_buffers, n_pickle = struct.unpack_from("<II", big, 4)
        struct.pack_into("<I", big, 8, n_pickle + 3)
        frame += 12 + 8 * n_buffers
    assert big[frame] == 0x95
    struct.pack_into("<Q", big, frame + 1, struct.unpack_from("<Q", big, frame + 1)[0] + 3)
    out.append(b"\x00" + bytes(big))
    return out


def protocol_inputs() -> list[bytes]:
    import msgspec

    from hotloop.engine import protocol as p

    messages = [
        p.AddRequest("r-1", [1, 2, 3], 16),
        p.AddRequest("r-2", list(range(40)), 1, stop_token_ids=[0, 2], temperature=0.7, seed=2**63 - 1,
                     ignore_eos=True, arrival_ns=123),
        p.AbortRequest(["r-1", "r-2"]),
        p.AbortRequest([]),
        p.StatsRequest(),
        p.ShutdownRequest(),
        p.OutputBatch([p.RequestOutput("r-1", [5, 6]), p.RequestOutput("r-2", [], True, "error", "boom")]),
        p.OutputBatch([]),
        p.StatsReport(3, [10, 20], 1, "park"),
    ]
    out = [b"\x00" + p.encoder.encode(m) for m in messages]
    enc = msgspec.msgpack.encode
    out += [b"\x00" + enc(v) for v in (
        ["add"], ["add", "r", [1], -1], ["add", "r", [2**64 - 1], 1], ["add", "r", "not a list", 1],
        ["abort", [1]], ["nope"], [], {}, None, "add", ["out", [["r", [1], False, None, None, 9]]],
        ["stats", 1, [1], 1, "x", "extra"], ["add", "r", [[[[[]]]]], 1],
    )]
    out += [b"\x00", b"\x00\xc1", b"\x00\xdd\xff\xff\xff\xff", b"\x00\x92\xa3add"]
    out += [b"\x01" + hashlib.sha256(b"protocol-%d" % i).digest() for i in range(16)]
    return out


def handle_inputs() -> list[bytes]:
    # The inputs drive a FuzzedDataProvider: any bytes are a case; these cover both writers and every kind.
    return [bytes([i % 2, i % 8]) + hashlib.sha256(b"handle-%d" % i).digest() * 2 for i in range(40)]


TARGETS = {"serialization": serialization_inputs, "protocol": protocol_inputs, "handle": handle_inputs}


def write(target: str) -> int:
    d = os.path.join(HERE, "corpus", target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    inputs = TARGETS[target]()
    for data in inputs:
        with open(os.path.join(d, hashlib.sha1(data).hexdigest()[:16]), "wb") as fh:
            fh.write(data)
    return len(inputs)


if __name__ == "__main__":
    for t in sys.argv[1:] or list(TARGETS):
        print(f"{t}: {write(t)} inputs in tests/fuzz/corpus/{t}")
