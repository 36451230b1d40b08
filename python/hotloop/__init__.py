"""hotloop: the hot loop of an LLM serving engine, made cheap.

The primitives come from the C++ core (``hotloop._core``):

- :class:`InputQueue`: in-process multi-producer queue of Python objects, a wait source.
- :class:`Flag`: a settable flag (cancel, shutdown), a wait source.
- :class:`FdSource`: a readable file descriptor (socket, pipe), a wait source.
- :func:`wait_any` / :class:`Waiter`: wait for any mix of sources in C++, GIL released; spin, yield, park.
- :class:`WaitPolicy`: the spin and yield budgets of a wait, fixed or adaptive.
- :class:`HostStepNotifier`: "step N is done" for CPU engines, completed by the thread that runs the steps.
- :class:`StepNotifier` (also ``hotloop.cuda.StepNotifier``): the same for work on CUDA streams.
- :class:`MessageQueue`: one writer, many reader processes, over a shared-memory ring; readers are wait sources.

Every exception hotloop raises is in :mod:`hotloop.errors`.
"""

from queue import Empty

from hotloop.errors import BadHandleError, DeadPeerError, HotloopError, QueueTimeout
from hotloop.queue import MessageQueue
from hotloop._core import (
    ClosedError,
    CudaError,
    FdSource,
    Flag,
    HostStepNotifier,
    InputQueue,
    Source,
    SourceError,
    StepError,
    StepNotifier,
    StepSettled,
    StepUntil,
    WaitPolicy,
    Waiter,
    __version__,
    wait_any,
)

__all__ = [
    "BadHandleError",
    "DeadPeerError",
    "MessageQueue",
    "ClosedError",
    "CudaError",
    "Empty",
    "FdSource",
    "HotloopError",
    "Flag",
    "HostStepNotifier",
    "InputQueue",
    "QueueTimeout",
    "Source",
    "SourceError",
    "StepError",
    "StepNotifier",
    "StepSettled",
    "StepUntil",
    "WaitPolicy",
    "Waiter",
    "__version__",
    "wait_any",
]
