"""Continuous-batching scheduler: FCFS, a token budget per step, a cap on running requests, chunked prefill.

Contract: ``add(request)`` validates and queues a request (RequestError on bad input, nothing queued; the checks
are ``check_request``'s, the same the clients run before sending, so a request built or encoded by hand is held
to them too);
``abort(ids)`` finishes requests wherever they are (waiting, running, or in the step now running: its token is
then dropped) and returns their final outputs; ``schedule()`` picks the next step's segments, running requests
first, then waiting ones in arrival order, splitting prompts that do not fit the remaining budget;
``update(tokens)`` takes the sampled tokens of that step and returns the outputs (new token, finished, reason).
A request finishes on max_tokens ("length"), a stop id or EOS ("stop"), abort ("abort"), or a failed draw of its
own ("error": sampling returned a SampleError for it; the other requests of the step go on). One step at a time.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from hotloop.engine.model import GREEDY_TEMPERATURE, SampleError, Segment
from hotloop.engine.protocol import AddRequest, FinishReason, RequestOutput
from hotloop.engine.tokenizer import EOS
from hotloop.errors import RequestError, RequestTypeError


_SEED_RANGE = (-(1 << 63), 1 << 63)


def _type_name(v) -> str:
    return f"{type(v).__name__} {v!r}"[:120]


def _integer(where: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise RequestTypeError(f"{where}{name} must be an integer, got {_type_name(v)}")
    return int(v)


def check_token_ids(where: str, name: str, ids, vocab_size: int) -> list[int]:
    """`ids` as a list of ints, each in 0..vocab_size-1 (RequestTypeError / RequestError otherwise; `where`
    prefixes the message, `name` names the field)."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
        raise RequestTypeError(f"{where}{name} must be a sequence of integer token ids, got {_type_name(ids)}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RequestTypeError(f"{where}{name} must be integers, got {_type_name(t)} at index {i}")
        out.append(int(t))
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}{name} {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
    return out


def check_request(request_id, prompt_token_ids, max_tokens, stop_token_ids=(), temperature=0.0, seed=0,
                  ignore_eos=False, *, vocab_size: int, max_model_len: int) -> AddRequest:
    """Validate a request's fields and return them as an AddRequest of plain Python values (numpy integers and
    tuples are accepted and converted). RequestTypeError (a TypeError) for a field of the wrong type,
    RequestError (a ValueError) for a value out of range; the message names the field and what is allowed.

    Allowed: ``request_id`` a str; ``prompt_token_ids`` a non-empty sequence of ints in 0..vocab_size-1;
    ``max_tokens`` an int >= 1 with prompt + max_tokens <= max_model_len; ``stop_token_ids`` ints in the vocabulary;
    ``temperature`` a finite real >= 0 (below GREEDY_TEMPERATURE, 1e-5, sampling is greedy, as at 0); ``seed`` an
    int that fits in 64 signed bits; ``ignore_eos`` a bool."""
    if not isinstance(request_id, str):
        raise RequestTypeError(f"request_id must be a str, got {_type_name(request_id)}")
    where = f"request {request_id!r}: "
    prompt = check_token_ids(where, "prompt token ids", prompt_token_ids, vocab_size)
    if not prompt:
        raise RequestError(f"{where}empty prompt (send at least one token)")
    max_tokens = _integer(where, "max_tokens", max_tokens)
    if max_tokens <= 0:
        raise RequestError(f"{where}max_tokens must be positive, got {max_tokens}")
    if len(prompt) + max_tokens > max_model_len:
        raise RequestError(f"{where}prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model's length "
                           f"limit {max_model_len}")
    stop = check_token_ids(where, "stop_token_ids", stop_token_ids, vocab_size)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise RequestTypeError(f"{where}temperature must be a real number, got {_type_name(temperature)}")
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(f"{where}temperature must be a finite number >= 0 (0, or below {GREEDY_TEMPERATURE}, "
                           f"is greedy), got {temperature}")
    seed = _integer(where, "seed", seed)
    if not _SEED_RANGE[0] <= seed < _SEED_RANGE[1]:
        raise RequestError(f"{where}seed must fit a signed 64-bit integer, got {seed}")
    if not isinstance(ignore_eos, bool):
        raise RequestTypeError(f"{where}ignore_eos must be a bool, got {_type_name(ignore_eos)}")
    return AddRequest(request_id, prompt, max_tokens, stop, temperature, seed, ignore_eos)


@dataclass
class Request:
    spec: AddRequest
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the KV cache
    status: str = "waiting"  # waiting -> running -> finished

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def capacity(self) -> int:
        return len(self.spec.prompt_token_ids) + self.spec.max_tokens

    def token(self, i: int) -> int:
        p = self.spec.prompt_token_ids
        return p[i] if i < len(p) else self.output_token_ids[i - len(p)]

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SchedulerOutput:
    segments: list[Segment]
    free_ids: list[str]  # requests whose KV caches the workers drop before this step


class Scheduler:
    def __init__(self, vocab_size: int, max_model_len: int, max_num_seqs: int = 64,
                 max_tokens_per_step: int = 512):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._in_flight: list[tuple[Request, int, bool]] | None = None  # (request, tokens, sampled) of the step
        self._free: list[str] = []

    # ---- input ----

    def add(self, spec: AddRequest) -> None:
        rid = spec.request_id
        if not isinstance(rid, str):
            raise RequestTypeError(f"request_id must be a str, got {_type_name(rid)}")
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use by an unfinished request")
        checked = check_request(rid, spec.prompt_token_ids, spec.max_tokens, spec.stop_token_ids, spec.temperature,
                                spec.seed, spec.ignore_eos, vocab_size=self.vocab_size,
                                max_model_len=self.max_model_len)
        checked.arrival_ns = spec.arrival_ns if isinstance(spec.arrival_ns, int) else 0
        req = Request(checked)
        self.requests[rid] = req
        self.waiting.append(req)

    def abort(self, request_ids) -> list[RequestOutput]:
        """Finish the given requests; unknown or finished ids are ignored."""
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                outs.append(RequestOutput(rid, [], True, FinishReason.ABORT))
        return outs

    def _finish(self, req: Request, reason: str) -> None:
        req.status = "finished"
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.num_computed or self._in_flight and any(r is req for r, _, _ in self._in_flight):
            self._free.append(req.request_id)

    # ---- steps ----

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        assert self._in_flight is None, "one step at a time"
        budget = self.max_tokens_per_step
        picked: list[tuple[Request, int, bool]] = []
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed, budget)
            picked.append((req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            req.status = "running"
            self.running.append(req)
            n = min(req.num_tokens, budget)
            picked.append((req, n, n == req.num_tokens))
            budget -= n
        segments = [Segment(r.request_id, [r.token(i) for i in range(r.num_computed, r.num_computed + n)],
                            r.num_computed, r.capacity, sample, r.spec.temperature, r.spec.seed)
                    for r, n, sample in picked]
        self._in_flight = picked
        free, self._free = self._free, []
        return SchedulerOutput(segments, free)

    def update(self, sampled: list[int]) -> list[RequestOutput]:
        """Apply the tokens sampled by the step schedule() returned (one per sampling segment, in order)."""
        picked, self._in_flight = self._in_flight, None
        outs = []
        tokens = iter(sampled)
        for req, n, sample in picked:
            token = next(tokens) if sample else None
            if req.status == "finished":
                continue  # aborted while the step ran
            req.num_computed += n
            if token is None:
                continue
            if isinstance(token, SampleError):  # this request's draw failed: it alone ends, with the reason
                self._finish(req, FinishReason.ERROR)
                outs.append(RequestOutput(req.request_id, [], True, FinishReason.ERROR, str(token)))
                continue
            req.output_token_ids.append(token)
            spec = req.spec
            reason = None
            if token in spec.stop_token_ids or (token == EOS and not spec.ignore_eos):
                reason = FinishReason.STOP
            elif len(req.output_token_ids) >= spec.max_tokens:
                reason = FinishReason.LENGTH
            if reason:
                self._finish(req, reason)
            outs.append(RequestOutput(req.request_id, [token], reason is not None, reason))
        return outs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with reason "engine_dead" (the executor failed; the engine stops)."""
        outs = [RequestOutput(rid, [], True, FinishReason.ENGINE_DEAD, error) for rid in list(self.requests)]
        for req in list(self.requests.values()):
            self._finish(req, FinishReason.ERROR)
        self._in_flight = None
        return outs
