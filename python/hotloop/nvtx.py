"""NVTX ranges for Nsight Systems timelines (see docs/profiling.md).

hotloop's C++ core already marks its waits (``hotloop.wait`` with ``hotloop.wait.spin`` / ``hotloop.wait.park``
inside), step marks and completions, all in the ``hotloop`` NVTX domain. Python code adds its own with
:class:`Range`, created once with a constant name::

    STEP = hotloop.nvtx.Range("engine.step")
    with STEP:
        ...
"""

from hotloop._core import NvtxRange as Range
from hotloop._core import nvtx_compiled_in as compiled_in

__all__ = ["Range", "compiled_in"]
