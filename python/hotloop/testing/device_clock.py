"""DeviceClock: a simulated accelerator's step time, shared by the tensor-parallel ranks of one model.

Contract:

- ``DeviceClock(name, rank, world, base_us, per_token_us)``: one object per rank process (ranks ``0..world-1``),
  all ranks with the same ``name`` and ``world``. ``step(tokens)`` is the device computing one forward pass of
  ``tokens`` tokens: the calling thread leaves the CPU (a futex or timer sleep, GIL released) until the step ends
  and returns ``(start_ns, end_ns)`` on CLOCK_MONOTONIC. The step lasts ``base_us + per_token_us x tokens`` and
  ends, on every rank, at ``max(start of each rank) + that time``: the ranks of a step end together, as a
  collective inside the forward makes them, and the last rank to start decides the end. A rank that is done
  with its own part first sleeps until the others have started (futex on their slots), never spins.
- Every rank calls ``step`` the same number of times (vLLM's TP ranks run the same steps, warm-up included).
  A rank that has not started step k within ``peer_timeout_s`` (60 s) makes the others raise RuntimeError
  naming it.
- The ranks meet in one shared-memory segment, ``/dev/shm/hotloop.devclock.<name>``, opened (created if absent)
  by each rank; rank 0 removes the name once every rank has run a step (the mappings stay), and ``close()``
  removes it too, so a normal run leaves nothing. Only ranks of one process tree (one user) share it: 0600.
- Cost per step on the CPU: a few microseconds (two stores, a futex wake, the checks of the peers' slots, one
  sleep). The thread's timer slack is set to 1 us on its first step (prctl, per thread), so a sleep ends within
  microseconds of the modelled end rather than Linux's default 50 us late.
- Not thread-safe: one thread per rank steps (vLLM's worker thread).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

_SLOT = 64  # one cache line per rank: u32 step number, pad, i64 start of even steps, i64 start of odd steps
_MAX_RANKS = 64
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_PR_SET_TIMERSLACK = 29

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, expected: int, timeout_ns: int) -> None:
    ts = _Timespec(timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000)
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts),
                  None, 0)  # returns on a wake, a changed word (EAGAIN), the timeout or a signal: the caller re-checks


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _sleep_until(t_ns: int) -> None:
    left = t_ns - time.monotonic_ns()
    if left > 0:
        time.sleep(left / 1e9)  # clock_nanosleep; releases the GIL


def segment_path(name: str) -> str:
    return f"/dev/shm/hotloop.devclock.{name}"


class DeviceClock:
    """The modelled device of one TP rank (see the module docstring)."""

    def __init__(self, name: str, rank: int, world: int, base_us: float, per_token_us: float,
                 peer_timeout_s: float = 60.0):
        if not 1 <= world <= _MAX_RANKS or not 0 <= rank < world:
            raise ValueError(f"simulated device: need 0 <= rank < world <= {_MAX_RANKS}, got rank {rank} of {world}")
        if base_us < 0 or per_token_us < 0:
            raise ValueError(f"simulated device: step times must be >= 0 us, got base {base_us}, "
                             f"per token {per_token_us}")
        self.name, self.rank, self.world = name, rank, world
        self.base_ns, self.per_token_ns = int(base_us * 1000), int(per_token_us * 1000)
        self.peer_timeout_ns = int(peer_timeout_s * 1e9)
        self.steps = 0
        self._path = segment_path(name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = _SLOT * _MAX_RANKS
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every rank truncates to the same size: harmless if another did first
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._base_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._words = [ctypes.c_uint32.from_buffer(self._map, r * _SLOT) for r in range(world)]
        # two starts per rank: a peer can be one step ahead (it ended step k and began k+1) but not two, since
        # step k+1 cannot end before this rank starts it
        self._starts = [[ctypes.c_int64.from_buffer(self._map, r * _SLOT + 8 + 8 * parity) for parity in (0, 1)]
                        for r in range(world)]
        self._slack_set: set[int] = set()
        self._unlinked = False

    def duration_ns(self, tokens: int) -> int:
        return self.base_ns + self.per_token_ns * max(0, int(tokens))

    def step(self, tokens: int) -> tuple[int, int]:
        """One forward pass of `tokens` tokens on the device: blocks off the CPU until it ends (see the contract)."""
        tid = threading.get_ident()
        if tid not in self._slack_set:
            _libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
            self._slack_set.add(tid)
        self.steps += 1
        k = self.steps & 0xFFFFFFFF
        start = time.monotonic_ns()
        me = self.rank
        self._starts[me][k & 1].value = start  # x86: this store is seen before the step number below (TSO)
        self._words[me].value = k
        if self.world > 1:
            _futex_wake(self._base_addr + me * _SLOT)
        duration = self.duration_ns(tokens)
        _sleep_until(start + duration)  # no rank can end before its own start + the step's time
        last = start
        for r in range(self.world):
            if r != me:
                last = max(last, self._wait_started(r, k, start))
        end = last + duration
        _sleep_until(end)
        if self.rank == 0 and not self._unlinked:
            self._unlink()  # every rank has opened the segment by now: the name is no longer needed
        return start, end

    def _wait_started(self, r: int, k: int, since: int) -> int:
        """Rank r's start of step k (sleeping on its slot until it posts it)."""
        word, addr = self._words[r], self._base_addr + r * _SLOT
        while True:
            seen = word.value
            if seen == k or seen == (k + 1) & 0xFFFFFFFF:  # r started k (and may have begun k+1 since)
                return self._starts[r][k & 1].value
            left = since + self.peer_timeout_ns - time.monotonic_ns()
            if left <= 0:
                raise RuntimeError(f"simulated device {self.name}: TP rank {r} did not start step {k} within "
                                   f"{self.peer_timeout_ns / 1e9:.0f} s of rank {self.rank} (at its step {seen}); "
                                   "every rank must run the same steps")
            _futex_wait(addr, seen, left)

    def _unlink(self) -> None:
        self._unlinked = True
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Forget the segment (rank 0 removes its name if still there)."""
        if self.rank == 0 and not self._unlinked:
            self._unlink()
        self._words, self._starts = [], []
        try:
            self._map.close()
        except BufferError:  # a ctypes view still alive elsewhere: the mapping goes with the process
            pass


def parse_spec(value: str) -> tuple[float, float]:
    """``HOTLOOP_VLLM_SIM_DEVICE``'s value: "1" (the defaults) or "BASE_US+PER_TOKEN_US" (e.g. "1300+2")."""
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return DEFAULT_BASE_US, DEFAULT_PER_TOKEN_US
    try:
        base, per_token = (float(x) for x in value.split("+"))
    except ValueError:
        raise ValueError(f"HOTLOOP_VLLM_SIM_DEVICE must be 1 or BASE_US+PER_TOKEN_US (e.g. 1300+2), got "
                         f"{value!r}") from None
    if base < 0 or per_token < 0:
        raise ValueError(f"HOTLOOP_VLLM_SIM_DEVICE: times must be >= 0 us, got {value!r}")
    return base, per_token


# Qwen3-0.6B on a GB200, the upstream engine-core change's figures: a single request decodes at ~700 tok/s
# (~1.4 ms a step, host work included) and TP=1 takes ~3,200 arrivals/s of 128 prompt tokens (~400k prefill
# tokens/s, <= 2.5 us a token). The device's share: 1.3 ms a step plus 2 us a token.
DEFAULT_BASE_US = 1300.0
DEFAULT_PER_TOKEN_US = 2.0

__all__ = ["DEFAULT_BASE_US", "DEFAULT_PER_TOKEN_US", "DeviceClock", "parse_spec", "segment_path"]
