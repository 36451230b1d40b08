"""ChainedReads: a vLLM reader's messages that come in chains, so the read after the first of a chain yields
through the short gap instead of parking.

Contract:

- On vLLM's async scheduling path a step is two messages: the engine core broadcasts ``execute_model`` and, tens of
  microseconds later, ``sample_tokens``; a worker that has just read the first reads the second next. On a host
  whose cores are all busy (the worker woke onto the core the engine core was about to write from) the second is
  often not there yet, and a reader that parks pays a futex sleep and a wake-up through the scheduler for a gap
  of tens of microseconds; yielding lets the writer run and takes the message without either.
- ``kind_of(obj)``: what a message is, from its first element where that is a string (vLLM's broadcast
  ``(method, args, kwargs, output_rank)``: ``"execute_model"``, ``"sample_tokens"``), else the type of its last
  element (an answer ``(status, result)``), else its own type. A dict lookup and a few isinstance checks.
- Per kind, the moving average (EMA, weight 1/4) of the wait for the message that follows it. ``budget_s()``: the
  yield budget of the next read: ``CHAIN_YIELD_US`` when the last message's kind has been followed within
  ``CHAIN_GAP_US`` on average, else 0 (the reader's own wait). So nothing is fixed to vLLM's method names: a kind
  whose follower comes a step later (``sample_tokens``, an answer read at a step's end) keeps the park.
- ``record(kind, waited_s, parked, chained)`` after each read that returned a message; ``stats()``: per kind of the
  message before, ``{"reads", "parks", "chained", "wait_us"}`` (reads after it, those that parked in the kernel,
  those given the chain's budget, their summed wait), the counters the bench reads. One object per reader; not
  thread-safe (a reader is read from one thread).
"""

from __future__ import annotations

# A kind whose follower came within this on average starts a chain: the gap between a step's two broadcasts is
# the engine core's work between them (tens of us); a step's interval on a GPU host is 1 ms and more.
CHAIN_GAP_US = 200.0
# The yield budget of a chained read: a few of the gaps above, and short against a step, so a chain broken by an
# idle period costs at most this much yielding before the park.
CHAIN_YIELD_US = 300.0


def kind_of(obj) -> str:
    if isinstance(obj, tuple) and obj:
        if isinstance(obj[0], str):
            return obj[0]
        return type(obj[-1]).__name__
    return type(obj).__name__


class ChainedReads:
    """The chain statistics of one reader (see the module docstring)."""

    __slots__ = ("after", "last", "counts")

    def __init__(self):
        self.after: dict[str, float] = {}  # kind -> EMA of the wait for the next message (s)
        self.last: str | None = None  # the kind of the message read last
        self.counts: dict[str, list] = {}  # kind before -> [reads, parks, chained, wait s]

    def budget_s(self) -> float:
        gap = self.after.get(self.last)
        return CHAIN_YIELD_US / 1e6 if gap is not None and gap * 1e6 < CHAIN_GAP_US else 0.0

    def record(self, kind: str, waited_s: float, parked: bool, chained: bool) -> None:
        last = self.last
        if last is not None:
            ema = self.after.get(last)
            self.after[last] = waited_s if ema is None else ema + (waited_s - ema) / 4
            c = self.counts.get(last)
            if c is None:
                c = self.counts[last] = [0, 0, 0, 0.0]
            c[0] += 1
            c[1] += parked
            c[2] += chained
            c[3] += waited_s
        self.last = kind

    def stats(self) -> dict[str, dict]:
        return {k: {"reads": c[0], "parks": c[1], "chained": c[2], "wait_us": c[3] * 1e6}
                for k, c in self.counts.items()}


def merged(stats: list[dict[str, dict]]) -> dict[str, dict]:
    """Several readers' stats() summed per kind."""
    out: dict[str, dict] = {}
    for s in stats:
        for kind, c in s.items():
            o = out.setdefault(kind, {"reads": 0, "parks": 0, "chained": 0, "wait_us": 0.0})
            for k in o:
                o[k] += c[k]
    return out
