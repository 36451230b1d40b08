"""Run at start-up by every Python process whose PYTHONPATH names this directory (``hotloop.vllm.omni.env()`` puts
it there for vllm-omni's caller, stage and worker processes; docs/vllm.md, "vllm-omni").

vllm-omni 0.30.0 imports every model of its registry when ``vllm_omni.config`` loads, in each of its processes, and
one chain (qwen2_5_omni -> vLLM's qwen2_vl -> transformers' Qwen2-VL image processor) imports
``torchvision.transforms.v2``. PyPI's torchvision is a CUDA build: next to torch's CPU build its C++ ops do not
load, and ``import torchvision`` then fails in its two op-registration modules (``RuntimeError: operator
torchvision::nms does not exist``). This finder answers those two modules with empty ones, only while
torchvision's ops are missing, so torchvision's Python parts import; text stages never call torchvision. Nothing
else is touched; with torchvision's CPU build (PyTorch's CPU index) it does nothing.

Python imports one ``sitecustomize``: this one takes the place of any later on the path (a plain venv has none).
"""

import importlib.abc
import importlib.machinery
import sys

_SKIPPED = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})


def _ops_loaded() -> bool:
    try:
        import torch

        torch.ops.torchvision.nms  # noqa: B018  (raises when torchvision's C++ ops did not load)
        return True
    except (AttributeError, RuntimeError, ImportError):
        return False


class _SkipTorchvisionOpRegistrations(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in _SKIPPED and not _ops_loaded():
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None  # the default: an empty module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _SkipTorchvisionOpRegistrations) for f in sys.meta_path):
    sys.meta_path.insert(0, _SkipTorchvisionOpRegistrations())
