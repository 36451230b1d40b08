"""Every exception hotloop raises, in one place. Each message says what happened and what to do about it.

The core's (C++, ``hotloop._core``; each keeps the builtin base a caller would catch):
  ClosedError (RuntimeError)       a queue or source was closed: nothing more will come from it.
  SourceError (OSError)            a source can no longer be waited on (its descriptor was closed).
  DeadPeerError (RuntimeError)     a peer process of a queue (its writer or a reader) died.
  BadHandleError (ValueError)      a queue handle does not describe a usable queue for that rank.
  QueueTimeout (TimeoutError)      a queue wait ran out: for a message, ring space, a remote reader's send
                                   buffer, or readers attaching (every MessageQueue timeout is one).
  StepError (RuntimeError)         a step completed through a step notifier failed (the device faulted, ...).
  CudaError (RuntimeError)         a CUDA driver call failed; CudaUnavailableError: no usable driver.

The Python layers' (all also ``HotloopError``):
  RequestError (ValueError)        a request the engine cannot serve; only that request fails.
    RequestTypeError (TypeError)   a request field of the wrong type.
  ExecutorError (RuntimeError)     the executor cannot run more steps (a worker died, the model raised, ...).
  EngineDeadError (RuntimeError)   the engine process died; start a new client.
    ReplicaDeadError               an orchestrator replica's process died.
  OrchestratorBrokenError          one of the orchestrator's own tasks died; start a new orchestrator.
"""

from __future__ import annotations

from hotloop._core import (BadHandleError, ClosedError, CudaError, CudaUnavailableError, DeadPeerError, QueueTimeout,
                           SourceError, StepError)


class HotloopError(Exception):
    """Base of the exceptions hotloop's Python layers raise (the core's keep their builtin bases only)."""


class RequestError(HotloopError, ValueError):
    """A request the engine cannot serve; only that request fails."""


class RequestTypeError(RequestError, TypeError):
    """A request field of the wrong type (also a RequestError: only that request fails)."""


class ExecutorError(HotloopError, RuntimeError):
    """The executor cannot run steps any more (a worker died, the model raised or the GPU faulted)."""


class EngineDeadError(HotloopError, RuntimeError):
    """The engine process died; nothing sent to it will be answered. Start a new client."""


class ReplicaDeadError(EngineDeadError):
    """An orchestrator replica's process died."""


class OrchestratorBrokenError(HotloopError, RuntimeError):
    """One of the orchestrator's own tasks died of an unexpected exception; it serves nothing more. Shut it down
    and start a new one."""


__all__ = ["BadHandleError", "ClosedError", "CudaError", "CudaUnavailableError", "DeadPeerError", "EngineDeadError",
           "ExecutorError", "HotloopError", "OrchestratorBrokenError", "QueueTimeout", "ReplicaDeadError",
           "RequestError", "RequestTypeError", "SourceError", "StepError"]
