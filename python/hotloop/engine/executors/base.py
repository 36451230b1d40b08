"""The executor interface: what the engine core needs from whatever runs its model, and the registry of executors
by name.

Contract: ``submit(scheduler_output)`` launches a step and returns at once (one step in flight at a time:
``in_flight``); ``sources`` are the wait_any sources that become ready when the step's result is there or the
executor failed, the same objects for the executor's life (set by the time its constructor returns), so the
engine waits on them together with its input queue in one prepared ``Waiter``; the step's sampled tokens (one per sampling request, in the step's order) come back through ``poll()``
(non-blocking: the tokens, or None while the step runs) or ``wait(timeout)`` (GIL released). A failed step or
executor (a worker died, the model raised, the device faulted) raises ExecutorError from poll / wait with what
happened; it never hangs. ``shutdown()`` stops everything the executor started and is idempotent.

``wait`` is implemented here once, over ``sources`` and ``poll``. Executors are made by name with
``create_executor(name, config, tp=..., step_delay_s=..., device=..., **options)``; ``register_executor`` adds
one (its class, or "module:Class" so that an executor with optional dependencies loads only when asked for).
"""

from __future__ import annotations

import abc
import importlib
import time

from hotloop._core import wait_any


class Executor(abc.ABC):
    """Runs the model's steps for one engine core (the module's contract)."""

    device: str = "cpu"
    notifier = None  # the step notifier this process completes steps on (in-process executors), else None
    sources: list = []
    in_flight: bool = False  # a step was submitted and its tokens not yet returned by poll / wait

    @abc.abstractmethod
    def submit(self, out) -> None:
        """Launch the step `out` (a SchedulerOutput); returns at once."""

    @abc.abstractmethod
    def poll(self):
        """The step's tokens once it is done (then the step is no longer in flight), else None."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop and release everything; idempotent."""

    @property
    def pids(self) -> list[int]:
        """The processes this executor runs its ranks in, other than the engine's own."""
        return []

    def wait(self, timeout: float | None = None):
        """The step's tokens, waiting (GIL released) up to `timeout` seconds for them: TimeoutError after that."""
        if not self.in_flight:
            raise RuntimeError("wait() without a step in flight: submit one first")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            tokens = self.poll()
            if tokens is not None:
                return tokens
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait_any(self.sources, timeout=left):
                raise TimeoutError(f"no step result within {timeout} s")


_REGISTRY: dict[str, type[Executor] | str] = {
    "inprocess": "hotloop.engine.executors.inprocess:InProcessExecutor",
    "multiproc": "hotloop.engine.executors.multiproc:MultiprocExecutor",
    "ray": "hotloop.engine.executors.ray:RayExecutor",  # needs the optional Ray (hotloop[ray])
}


def register_executor(name: str, executor: type[Executor] | str) -> None:
    """Make `executor` (an Executor subclass, or "module:Class" imported on first use) available by `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an executor name is a non-empty str, got {name!r}")
    _REGISTRY[name] = executor


def executor_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def executor_class(name: str) -> type[Executor]:
    """The class registered as `name`; ValueError naming the known ones for any other."""
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"executor must be one of {executor_names()} or an Executor, got {name!r}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise ValueError(f"executor {name!r} cannot be loaded: {e}") from e
        _REGISTRY[name] = entry
    return entry


def create_executor(name: str, config, *, tp: int = 1, step_delay_s: float = 0.0, device: str = "cpu",
                    **options) -> Executor:
    """A new executor of the kind registered as `name`, running `config` with `tp` ranks on `device` (resolved:
    "cpu", "cuda" or "cuda:N"); `options` go to that executor's constructor."""
    return executor_class(name)(config, tp=tp, step_delay_s=step_delay_s, device=device, **options)
