"""hotloop.vllm.omni: vllm-omni 0.30.0's pipelines with hotloop's queue in every stage (docs/vllm.md, "vllm-omni").

Contract:

- vllm-omni runs each stage replica as a vLLM engine core (``StageEngineCoreProc``) in its own process with its
  ``VLLM::Worker`` process(es); each stage's engine core <-> worker hop is vLLM's shared-memory ``MessageQueue``,
  the class ``hotloop.vllm`` replaces. Every one of those processes loads vLLM's ``vllm.general_plugins``, so
  ``HOTLOOP_VLLM=1`` in the environment vllm-omni starts from (``env()``) puts hotloop's queue in all of them; each
  logs the plugin's line ``hotloop: vLLM ... runs on hotloop's MessageQueue ... in process PID``. Nothing of
  vllm-omni is patched.
- ``register_text_pipeline()`` registers, through vllm-omni's out-of-tree hook ``register_pipeline``, a pipeline of
  ``stages`` plain text (``LlamaForCausalLM``) stages: stage 0 takes the prompt, each later stage takes the
  previous stage's generated token ids as its prompt, the last one's text is the output. Call it in the process
  that builds ``AsyncOmni`` / ``Omni`` (pipelines are resolved there; the stage processes get resolved configs).
- ``write_deploy_yaml()`` writes the deploy file that runs those stages on a CPU: vllm-omni has no CPU platform, so
  each stage names vLLM's ``CPUWorker`` and gets its OpenMP binding and KV cache size in its environment.
- ``env()`` is the environment a vllm-omni program should start from: the hotloop switch, vllm-omni's
  event-driven orchestrator switch (``VLLM_OMNI_EVENT_DRIVEN_ORCH``) and, when PyPI's torchvision (a CUDA build)
  is installed next to torch's CPU build, ``PYTHONPATH`` naming ``SITE_DIR`` (its ``sitecustomize`` lets
  torchvision's Python parts import; vllm-omni's model registry imports them in every process).
- ``prepare()`` does the same from inside a vllm-omni program, before vllm-omni is imported: ``os.environ`` as
  ``env()`` gives it, and the torchvision fix in the program's own process.
- ``stage_processes_on_hotloop(log_text)`` reads the plugin's lines out of a run's log: pid -> vLLM version.

Nothing here imports vllm-omni or vLLM at import time.
"""

from __future__ import annotations

import os
import re

TEXT_PIPELINE = "hotloop_text"  # registered as f"{TEXT_PIPELINE}{stages}"
SUPPORTED_VLLM_OMNI = "0.30.0"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_omni_site")
EVENT_DRIVEN_ENV = "VLLM_OMNI_EVENT_DRIVEN_ORCH"
PLUGIN_LINE = re.compile(r"hotloop: vLLM (\S+) runs on hotloop's MessageQueue .*? in process (\d+)")


def vllm_omni_version() -> str | None:
    """The installed vllm-omni's version, or None (nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version("vllm-omni")
    except metadata.PackageNotFoundError:
        return None


def importable() -> tuple[bool, str]:
    """Whether ``vllm_omni`` imports here (in a child process, with ``env()``'s path; importing it takes seconds and
    loads vLLM), and why not."""
    import subprocess
    import sys

    if vllm_omni_version() is None:
        return False, "vllm-omni is not installed (scripts/install_vllm_omni.sh installs 0.30.0 for text stages)"
    p = subprocess.run([sys.executable, "-c", "import vllm_omni.config"], env=env(), capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"vllm_omni does not import here ({last}); it needs vLLM 0.30 (scripts/install_vllm_omni.sh)"
    return True, ""


def torchvision_needs_shim() -> bool:
    """Whether torchvision is installed without its C++ ops loading (PyPI's CUDA build next to torch's CPU build):
    then ``SITE_DIR`` goes on PYTHONPATH. Checked in a child process (importing torch takes a while)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torchvision") is None:
        return False
    code = "import torch, torchvision; torch.ops.torchvision.nms"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode != 0


_shim: bool | None = None


def env(hotloop: bool = True, event_driven: bool = True, base: dict | None = None) -> dict:
    """The environment for a vllm-omni program: hotloop's queue in every stage's engine core and workers (or
    vLLM's own with ``hotloop=False``), vllm-omni's event-driven orchestrator and drain on or off, and the
    torchvision path fix where it is needed."""
    global _shim
    out = dict(os.environ if base is None else base)
    out["HOTLOOP_VLLM"] = "1" if hotloop else "0"
    out[EVENT_DRIVEN_ENV] = "1" if event_driven else "0"
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    if _shim is None:
        _shim = torchvision_needs_shim()
    if _shim:
        parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
        out["PYTHONPATH"] = os.pathsep.join([SITE_DIR] + parts)
    return out


def prepare(hotloop: bool = True, event_driven: bool = True) -> None:
    """In a vllm-omni program, before vllm-omni is imported: ``os.environ`` as ``env()`` gives it (the processes
    vllm-omni and vLLM start inherit it) and the torchvision fix in this process too, where it is needed."""
    os.environ.update(env(hotloop, event_driven, base=dict(os.environ)))
    if _shim:
        import importlib.util

        spec = importlib.util.spec_from_file_location("hotloop_omni_site", os.path.join(SITE_DIR, "sitecustomize.py"))
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def register_text_pipeline(stages: int = 2, arch: str = "LlamaForCausalLM") -> str:
    """Register a pipeline of `stages` text stages of architecture `arch` with vllm-omni; returns its name (the
    deploy file's ``pipeline:``). Idempotent."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    name = f"{TEXT_PIPELINE}{stages}"
    if name in OMNI_PIPELINES:
        return name
    stage_list = tuple(
        StagePipelineConfig(stage_id=i, model_stage=f"text_{i}", execution_type=StageExecutionType.LLM_AR,
                            input_sources=(i - 1,) if i else (), final_output=i == stages - 1,
                            final_output_type="text" if i == stages - 1 else None)
        for i in range(stages))
    register_pipeline(PipelineConfig(model_type=name, model_arch=arch, stages=stage_list))
    return name


def write_deploy_yaml(path: str, pipeline: str, stages: int = 2, bind: list[str] | None = None,
                      kv_cache_gib: int = 1, max_model_len: int = 512, max_num_seqs: int = 16,
                      memory_fraction: float = 0.15) -> str:
    """Write the CPU deploy file of a registered text pipeline to `path`. Each stage: vLLM's CPU worker (vllm-omni
    has no CPU platform), the multiprocess executor (its worker in its own process, reached over the
    MessageQueue), eager mode, no async scheduling, `memory_fraction` of the machine's memory per stage (vLLM's
    ``gpu_memory_utilization``, which its CPU worker checks against free memory at start); ``bind[i]`` is stage
    i's ``VLLM_CPU_OMP_THREADS_BIND`` (default: stage i on core i modulo the machine's cores)."""
    ncpu = os.cpu_count() or 1
    bind = bind or [str(i % ncpu) for i in range(stages)]
    lines = [f"pipeline: {pipeline}", "async_chunk: false", "distributed_executor_backend: mp", "dtype: float32",
             "stages:"]
    for i in range(stages):
        lines += [f"  - stage_id: {i}", f"    max_model_len: {max_model_len}", f"    max_num_seqs: {max_num_seqs}",
                  f"    gpu_memory_utilization: {memory_fraction}",
                  "    enforce_eager: true", "    async_scheduling: false",
                  "    engine_extras:", "      worker_cls: vllm.v1.worker.cpu_worker.CPUWorker", "      seed: 0",
                  "    env:", f"      VLLM_CPU_OMP_THREADS_BIND: \"{bind[i]}\"",
                  f"      VLLM_CPU_KVCACHE_SPACE: \"{kv_cache_gib}\""]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def stage_processes_on_hotloop(log_text: str) -> dict[int, str]:
    """pid -> vLLM version of every process whose log line says it runs on hotloop's MessageQueue."""
    return {int(m.group(2)): m.group(1) for m in PLUGIN_LINE.finditer(log_text)}


__all__ = ["EVENT_DRIVEN_ENV", "SITE_DIR", "SUPPORTED_VLLM_OMNI", "TEXT_PIPELINE", "env", "importable", "prepare",
           "register_text_pipeline", "stage_processes_on_hotloop", "torchvision_needs_shim", "vllm_omni_version",
           "write_deploy_yaml"]
