"""Which device the engine runs its model on: ``resolve_device`` turns the engine's ``device`` option ("cpu",
"cuda", "cuda:N", "auto") into the device to run on, or says why CUDA cannot be used (``cuda_problem``)."""

from __future__ import annotations

import os

import torch

DEVICES = ("cpu", "cuda", "cuda:N", "auto")


def cuda_problem() -> str | None:
    """None when the engine can run on CUDA here, else why not (torch sees no GPU, hotloop cannot open the
    driver, or hotloop opened the fake test driver, which cannot see torch's streams)."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU / driver)"
    import hotloop.cuda
    from hotloop.testing import FAKE_CUDA_LIBRARY

    why = hotloop.cuda.unavailable_reason()
    if why is not None:
        return f"hotloop cannot open the CUDA driver: {why}"
    if os.path.realpath(hotloop.cuda.driver_info()["path"]) == os.path.realpath(FAKE_CUDA_LIBRARY):
        return ("hotloop opened its fake CUDA driver ($HOTLOOP_CUDA_DRIVER), which cannot complete work on torch's "
                "streams: unset HOTLOOP_CUDA_DRIVER (in the test suite: HOTLOOP_TEST_CUDA=real)")
    return None


def resolve_device(device: str) -> str:
    """The device to run on: "cpu", or "cuda" / "cuda:N"; "auto" is CUDA when :func:`cuda_problem` finds none,
    else the CPU. Raises ValueError for an unknown name or a CUDA device that cannot be used, saying why."""
    name = str(device)
    if name == "cpu":
        return "cpu"
    if name == "auto":
        return "cuda" if cuda_problem() is None else "cpu"
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        why = cuda_problem()
        if why is not None:
            raise ValueError(f"device={name!r} cannot be used: {why}; use device='cpu' (or 'auto')")
        return name
    raise ValueError(f"device must be one of {DEVICES} (N a GPU index), got {device!r}")

