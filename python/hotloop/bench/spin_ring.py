"""A pure-Python shared-memory ring that spins on both sides: the floor ``hotloop bench queue`` compares
MessageQueue's bytes path with (what Python alone can do between two processes, with no system call and no wait).

Contract: one writer and one reader, in processes forked after the ring was made (the mapping is inherited).
``send`` copies a bytes-like message of at most ``slot_bytes`` into the next slot, spinning while every slot is
full; ``recv`` spins until a message is there and returns its own copy (bytes). Both spin in Python holding the
GIL and burning a core, yielding the CPU (sched_yield) every ``SPINS_PER_YIELD`` checks so that the two sides make
progress when they share a core: a benchmark floor, never a queue for real use (no timeout, no liveness, no
wake-up).
Ordering relies on x86's store order (the slot is written before the count that publishes it).
"""

from __future__ import annotations

import os
import struct
from multiprocessing import shared_memory

_COUNTS = 128  # the written count at byte 0, the read count at byte 64: separate cache lines
_LENGTH = struct.Struct("<Q")
SPINS_PER_YIELD = 1000  # ~50-100 us of checks: far above a round trip, short next to a scheduler time slice


class SpinRing:
    def __init__(self, slots: int = 1024, slot_bytes: int = 64 * 1024):
        self.slots, self.stride = slots, _LENGTH.size + slot_bytes
        self.slot_bytes = slot_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=_COUNTS + slots * self.stride)
        self._counts = self._shm.buf[:_COUNTS].cast("Q")  # [0] written, [8] read
        self._data = self._shm.buf[_COUNTS:]
        self._written = self._read = 0  # this side's own count

    def send(self, data) -> None:
        n = len(data)
        if n > self.slot_bytes:
            raise ValueError(f"a {n}-byte message does not fit a {self.slot_bytes}-byte slot")
        counts, head = self._counts, self._written
        spins = 0
        while head - counts[8] >= self.slots:
            spins += 1
            if spins % SPINS_PER_YIELD == 0:
                os.sched_yield()
        off = (head % self.slots) * self.stride
        _LENGTH.pack_into(self._data, off, n)
        self._data[off + 8:off + 8 + n] = data
        self._written = head + 1
        counts[0] = head + 1

    def recv(self) -> bytes:
        counts, tail = self._counts, self._read
        spins = 0
        while counts[0] == tail:
            spins += 1
            if spins % SPINS_PER_YIELD == 0:
                os.sched_yield()
        off = (tail % self.slots) * self.stride
        (n,) = _LENGTH.unpack_from(self._data, off)
        out = bytes(self._data[off + 8:off + 8 + n])
        self._read = tail + 1
        counts[8] = tail + 1
        return out

    def close(self) -> None:
        """Unmap and remove the segment (the process that made the ring)."""
        self._counts.release()
        self._data.release()
        self._shm.close()
        self._shm.unlink()
