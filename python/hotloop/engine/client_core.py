"""ClientCore: what an engine client does between its caller and its sockets, without any I/O, shared by the
blocking and the asyncio client (and the orchestrator's request building: ``checked_request``).

Contract: ``add(...)`` checks a request (``checked_request``), assigns its id when none is given, refuses an id
that is already streaming, registers the stream's ``sink`` (a callable taking each RequestOutput) and returns
the AddRequest to send; ``route(msg)`` hands each output of an OutputBatch to its stream's sink and returns a
StatsReport, if that is what arrived, for the caller to deliver; ``outcome(out)`` turns one output into what its
iterator does: raise EngineDeadError (ENGINE_DEAD: the engine stays dead for every later call) or RequestError
(ERROR), or return whether the stream is finished. ``engine_died(why)`` records the engine's death (process
exit, reader failure) and returns the error; ``check_alive()`` raises it for every later call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hotloop.engine import tokenizer
from hotloop.engine.model import model_config
from hotloop.engine.protocol import AddRequest, FinishReason, OutputBatch, RequestOutput, StatsReport
from hotloop.engine.scheduler import check_request
from hotloop.errors import EngineDeadError, RequestError, RequestTypeError


def _prompt_ids(prompt):
    """Token ids of a prompt (text is tokenized; ids are checked by check_request)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise RequestTypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    return prompt


def checked_request(model, request_id, prompt, max_tokens, stop_token_ids, temperature, seed,
                    ignore_eos) -> AddRequest:
    """The AddRequest for these arguments, checked against `model`'s vocabulary and length (raises
    RequestTypeError / RequestError naming the field and what is allowed)."""
    config = model_config(model)
    if stop_token_ids is None:
        stop_token_ids = ()
    return check_request(request_id, _prompt_ids(prompt), max_tokens, stop_token_ids, temperature, seed, ignore_eos,
                         vocab_size=config.vocab_size, max_model_len=config.max_seq_len)


class ClientCore:
    def __init__(self, model):
        self.model = model
        self.streams: dict[str, Callable[[RequestOutput], None]] = {}
        self.dead: EngineDeadError | None = None
        self._ids = itertools.count()

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def engine_died(self, why: str) -> EngineDeadError:
        if self.dead is None:
            self.dead = EngineDeadError(why)
        return self.dead

    def add(self, sink: Callable[[RequestOutput], None], prompt, max_tokens, stop_token_ids, temperature, seed,
            ignore_eos, request_id: str | None) -> AddRequest:
        self.check_alive()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        spec = checked_request(self.model, rid, prompt, max_tokens, stop_token_ids, temperature, seed, ignore_eos)
        if rid in self.streams:
            raise RequestError(f"request id {rid!r} is already streaming from this client")
        self.streams[rid] = sink
        return spec

    def remove(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def route(self, msg: OutputBatch | StatsReport) -> StatsReport | None:
        if isinstance(msg, StatsReport):
            return msg
        for out in msg.outputs:
            sink = self.streams.get(out.request_id)
            if sink is not None:
                sink(out)
        return None

    def outcome(self, out: RequestOutput) -> bool:
        """Whether `out` ends its stream; raises what its iterator raises instead of yielding it."""
        if out.finish_reason == FinishReason.ENGINE_DEAD:
            raise self.engine_died(out.error)
        if out.error:
            raise RequestError(out.error)
        return out.finished
