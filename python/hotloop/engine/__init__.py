"""A thin LLM engine on hotloop's primitives: a small torch model, a continuous-batching scheduler, the engine core
loop in three wait modes (block / poll / hotloop), in-process and multi-process executors, the engine process and
its clients."""

try:
    import torch  # noqa: F401  (the model, the workers and the transform stage run on it)
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError(
        "hotloop.engine (the engine, the orchestrator, `hotloop soak`, `hotloop bench engine` / `orchestrator`) "
        "needs PyTorch, which a plain `pip install hotloop` leaves out: pip install torch==2.13.0 (the CPU build) "
        "or \"hotloop[engine]\" (any torch >= 2.1)", name="torch") from None

from hotloop.engine.core import WAIT_MODES, EngineCore  # noqa: E402
from hotloop.engine.executors import Executor, create_executor, register_executor  # noqa: E402
from hotloop.engine.model import PRESETS, ModelConfig  # noqa: E402
from hotloop.engine.protocol import AbortRequest, AddRequest, RequestOutput  # noqa: E402
from hotloop.errors import EngineDeadError, ExecutorError, RequestError, RequestTypeError  # noqa: E402

__all__ = ["AbortRequest", "AddRequest", "EngineCore", "EngineDeadError", "Executor", "ExecutorError", "ModelConfig",
           "PRESETS", "RequestError", "RequestOutput", "RequestTypeError", "WAIT_MODES", "create_executor",
           "register_executor"]
