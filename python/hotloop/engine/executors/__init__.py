"""Executors run the engine's model: the interface and registry (base.py), the engine side of ranks in worker
processes (worker_group.py) and what each worker runs (worker.py), and the executors by name: "inprocess"
(inprocess.py), "multiproc" (multiproc.py) and "ray" (ray.py: loaded when asked for)."""

from hotloop.engine.executors.base import (Executor, create_executor, executor_class, executor_names,
                                           register_executor)
from hotloop.errors import ExecutorError

__all__ = ["Executor", "ExecutorError", "create_executor", "executor_class", "executor_names", "register_executor"]
