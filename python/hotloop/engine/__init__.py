"""A thin LLM engine on hotloop's primitives: a small torch model, a continuous-batching scheduler, the engine core
loop in three wait modes (block / poll / hotloop), in-process and multi-process executors, the engine process and
its clients."""

from hotloop.engine.core import WAIT_MODES, EngineCore
from hotloop.engine.executors import Executor, create_executor, register_executor
from hotloop.engine.model import PRESETS, ModelConfig
from hotloop.engine.protocol import AbortRequest, AddRequest, RequestOutput
from hotloop.errors import EngineDeadError, ExecutorError, RequestError, RequestTypeError

__all__ = ["AbortRequest", "AddRequest", "EngineCore", "EngineDeadError", "Executor", "ExecutorError", "ModelConfig",
           "PRESETS", "RequestError", "RequestOutput", "RequestTypeError", "WAIT_MODES", "create_executor",
           "register_executor"]
