"""DeviceClock: a simulated accelerator's stream, shared by the tensor-parallel ranks of one model.

Contract:

- ``DeviceClock(name, rank, world, base_us, per_token_us)``: one object per rank process (ranks ``0..world-1``),
  all ranks with the same ``name`` and ``world``. A step (one forward pass of ``tokens`` tokens) lasts
  ``base_us + per_token_us x tokens`` on the device.
- The device runs steps in order, as a stream does: step k starts when it is launched and the device is done with
  step k-1, and ends, on every rank, at ``max(launch of k on each rank, end of k-1) + its time`` (the TP ranks
  of a step end together, as a collective inside the forward makes them; the last rank to launch decides).
  - ``launch(tokens)`` queues a step and returns its number at once (a GPU forward returns once its kernels are
    queued); ``wait(k)`` blocks until step k has ended and returns ``(launch_ns, end_ns)`` on CLOCK_MONOTONIC;
    ``done(k)`` says, without blocking, whether it is known to have (a wait settled its end and that time has
    passed; a step nobody waited on reads not done). ``step(tokens)`` is ``wait(launch(tokens))``: a forward
    that blocks for its device time (vLLM's synchronous path).
  - ``tail()``: the number of the last step launched (what an event recorded now waits for), 0 before any.
  - A waiting thread leaves the CPU (a futex or timer sleep, GIL released) until the step ends; a rank that needs
    a peer's launch of step k sleeps on that peer's slot, never spins. Waits may come from another thread than
    launches (vLLM's async output copy thread), in any order of steps; one launching thread per rank.
- Every rank launches the same steps (vLLM's TP ranks run the same steps, warm-up included). A rank that has not
  launched step k within ``peer_timeout_s`` (60 s) of this rank makes its waits raise RuntimeError naming it. A
  rank keeps its last 16 launch times for its peers: a wait on a step that a peer launched 16 or more of its
  steps ago raises RuntimeError (vLLM keeps at most 2 in flight).
- The ranks meet in one shared-memory segment, ``/dev/shm/hotloop.devclock.<name>``, opened (created if absent)
  by each rank; rank 0 removes the name once every rank has run a step (the mappings stay), and ``close()``
  removes it too, so a normal run leaves nothing. Only ranks of one process tree (one user) share it: 0600.
- Cost per step on the CPU: a few microseconds (two stores, a futex wake, the checks of the peers' slots, one
  sleep). A waiting thread's timer slack is set to 1 us on its first wait (prctl, per thread), so a sleep ends
  within microseconds of the modelled end rather than Linux's default 50 us late.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

_RING = 16  # launch times a rank keeps for its peers (steps k mod 16)
_SLOT = 192  # per rank: u32 last launched step, pad, then _RING i64 launch times; three cache lines
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
        self._launches = [[ctypes.c_int64.from_buffer(self._map, r * _SLOT + 8 + 8 * i) for i in range(_RING)]
                          for r in range(world)]
        self._slack_set: set[int] = set()
        self._unlinked = False
        self._lock = threading.Lock()  # this rank's timeline: launches (one thread) and waits (any thread)
        self.steps = 0  # steps launched
        self._queued: dict[int, tuple[int, int]] = {}  # step -> (launch_ns, duration_ns), launched, end unknown
        self._settled = 0  # the steps up to this one have known ends
        self._last_end = 0  # the end of step _settled
        self._ends: dict[int, tuple[int, int]] = {}  # step -> (launch_ns, end_ns), the last _RING settled ones

    def duration_ns(self, tokens: int) -> int:
        return self.base_ns + self.per_token_ns * max(0, int(tokens))

    def launch(self, tokens: int) -> int:
        """Queue one forward pass of `tokens` tokens on this rank's device; returns its step number at once."""
        now = time.monotonic_ns()
        with self._lock:
            self.steps += 1
            k = self.steps
            self._queued[k] = (now, self.duration_ns(tokens))
        me = self.rank
        self._launches[me][k % _RING].value = now  # x86: this store is seen before the step number below (TSO)
        self._words[me].value = k & 0xFFFFFFFF
        if self.world > 1:
            _futex_wake(self._base_addr + me * _SLOT)
        return k

    def tail(self) -> int:
        return self.steps

    def done(self, k: int) -> bool:
        """Whether step k is known to have ended (see the contract)."""
        with self._lock:
            ended = self._ends.get(k)
            if ended is None and 0 < k <= self._settled:
                return True  # settled long ago
        return ended is not None and time.monotonic_ns() >= ended[1]

    def wait(self, k: int) -> tuple[int, int]:
        """Block off the CPU until step k has ended; returns (its launch on this rank, its end)."""
        if not 0 < k <= self.steps:
            raise ValueError(f"simulated device {self.name}: step {k} was never launched (launched: {self.steps})")
        tid = threading.get_ident()
        if tid not in self._slack_set:
            _libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
            self._slack_set.add(tid)
        while True:
            with self._lock:
                if k in self._ends:
                    launch, end = self._ends[k]
                    break
                if k <= self._settled:
                    raise ValueError(f"simulated device {self.name}: step {k} ended too long ago to be waited on")
                j = self._settled + 1
                launch, duration = self._queued[j]
                floor = max(launch, self._last_end)
            # The end of step j: no earlier than this rank's own view; then every peer's launch of it.
            _sleep_until(floor + duration)
            last = floor
            for r in range(self.world):
                if r != self.rank:
                    last = max(last, self._wait_launched(r, j, launch))
            with self._lock:
                if self._settled == j - 1:  # another waiting thread may have settled it meanwhile
                    self._last_end = last + duration
                    self._settled = j
                    del self._queued[j]
                    self._ends[j] = (launch, self._last_end)
                    self._ends.pop(j - _RING, None)
        _sleep_until(end)
        if self.rank == 0 and not self._unlinked:
            self._unlink()  # every rank has opened the segment by now: the name is no longer needed
        return launch, end

    def step(self, tokens: int) -> tuple[int, int]:
        """One forward pass of `tokens` tokens that blocks off the CPU until it ends (see the contract)."""
        return self.wait(self.launch(tokens))

    def _wait_launched(self, r: int, k: int, since: int) -> int:
        """Rank r's launch time of step k (sleeping on its slot until it posts it)."""
        word, addr = self._words[r], self._base_addr + r * _SLOT
        while True:
            seen = word.value
            ahead = (seen - k) & 0xFFFFFFFF
            if ahead < _RING:  # r launched k (and maybe a few more since)
                return self._launches[r][k % _RING].value
            if ahead < 0x80000000:
                raise RuntimeError(f"simulated device {self.name}: TP rank {r} is at step {seen}, {ahead} steps past "
                                   f"step {k} that rank {self.rank} waits on: more than {_RING} steps in flight")
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
        self._words, self._launches = [], []
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
