#!/usr/bin/env bash
# The GPU check (under 5 minutes on a machine with an NVIDIA GPU): runs the StepNotifier test suite against the
# real driver and `hotloop bench notifier` (kernel end -> waiter latency and CPU, each mechanism next to torch's
# event waits and a Python event.query() spin). Prints everything; writes build/gpu-check/*.
#
# Needs: an NVIDIA driver, hotloop installed (or buildable here), pytest, and torch with CUDA for the kernels.
# Without network access, build the wheel elsewhere and set HOTLOOP_WHEEL=path/to/hotloop-*.whl.
set -uo pipefail
cd "$(dirname "$0")/.."
out=build/gpu-check
mkdir -p "$out"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -4
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" 2>&1

if ! python3 -c "import hotloop" 2>/dev/null; then
  echo "== installing hotloop"
  if [ -n "${HOTLOOP_WHEEL:-}" ]; then
    python3 -m pip install -q --no-deps "$HOTLOOP_WHEEL"
  else
    python3 -m pip install -q --no-build-isolation . || python3 -m pip install -q .
  fi
fi
hotloop info

echo "== driver seen by hotloop"
python3 -c "import hotloop.cuda as c; print(c.is_available(), c.unavailable_reason() or c.driver_info())"

echo "== StepNotifier tests against the real driver"
(cd tests && HOTLOOP_TEST_CUDA=real timeout 180 python3 -m pytest -q -rs test_cuda_step_notifier.py) 2>&1 \
  | tee "$out/tests.txt" | tail -25

echo "== hotloop bench notifier"
timeout 240 hotloop bench notifier --json "$out/notifier.json" 2>&1 | tee "$out/bench.txt"
