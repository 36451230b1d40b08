"""A thin LLM engine on hotloop's primitives: a small torch model, a continuous-batching scheduler, the engine core
loop in three wait modes (block / poll / hotloop), in-process and multi-process executors, the engine process and
its clients."""

from hotloop.engine.core import WAIT_MODES, EngineCore
from hotloop.engine.executor import ExecutorError
from hotloop.engine.model import PRESETS, ModelConfig
from hotloop.engine.protocol import AbortRequest, AddRequest, RequestOutput
from hotloop.engine.scheduler import RequestError

__all__ = ["AbortRequest", "AddRequest", "EngineCore", "ExecutorError", "ModelConfig", "PRESETS", "RequestError",
           "RequestOutput", "WAIT_MODES"]
