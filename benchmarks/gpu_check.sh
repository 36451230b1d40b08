#!/usr/bin/env bash
# The GPU check (about 6 minutes on a machine with an NVIDIA GPU), one command: bash benchmarks/gpu_check.sh
#   1. the StepNotifier tests and the engine's notifier tests (device="cuda": identical outputs in every wait mode
#      and executor) against the real driver;
#   2. `hotloop bench notifier`: kernel end -> waiter back in Python and CPU while waiting, each mechanism next to
#      torch.cuda.Event.synchronize() and a Python event.query() spin;
#   3. `hotloop bench engine` with device="cuda": block / poll / hotloop, in-process and multiproc, model "small":
#      throughput, TTFT / ITL, queue wait, CPU per token and idle CPU.
# Prints everything; writes build/gpu-check/* (tests-*.txt, notifier.json, bench.txt, engine.json, engine.txt,
# engine.png). Exits 2 at once with no usable GPU, 1 if a test failed.
#
# Needs: an NVIDIA driver, torch with CUDA, hotloop installed (or buildable here), pytest. Without network access,
# build the wheel elsewhere and set HOTLOOP_WHEEL=path/to/hotloop-*.whl (pyzmq and msgspec must be installed).
set -uo pipefail
cd "$(dirname "$0")/.."
out=build/gpu-check
mkdir -p "$out"
status=0

echo "== machine"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or lists no device). Run it on a machine with an" \
       "NVIDIA GPU and driver; on a CPU, 'hotloop bench notifier' and 'hotloop bench engine' measure what they can." >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -4
if ! python3 -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)" 2>&1; then
  echo "gpu_check: torch does not see the GPU (a CPU build of torch, or a driver too old for it): install a CUDA" \
       "build, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu130" >&2
  exit 2
fi

if ! python3 -c "import hotloop" 2>/dev/null; then
  echo "== installing hotloop"
  if [ -n "${HOTLOOP_WHEEL:-}" ]; then
    python3 -m pip install -q --no-deps "$HOTLOOP_WHEEL"
  else
    python3 -m pip install -q --no-build-isolation . || python3 -m pip install -q --no-build-isolation --no-deps .
  fi
fi
hotloop info

echo "== driver seen by hotloop"
if ! python3 -c "import sys, hotloop.cuda as c; r = c.unavailable_reason(); print(r or c.driver_info());
sys.exit(1 if r else 0)"; then
  echo "gpu_check: hotloop cannot open the CUDA driver (the reason is above)" >&2
  exit 2
fi

# One pytest process per file: a crash in one suite does not hide the other's results.
for suite in test_cuda_step_notifier.py test_engine_notifier.py; do
  echo "== $suite against the real driver"
  (cd tests && HOTLOOP_TEST_CUDA=real timeout 300 python3 -m pytest -q -rs -p no:cacheprovider "$suite") 2>&1 \
    | tee "$out/tests-${suite%.py}.txt" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "== hotloop bench notifier"
timeout 240 hotloop bench notifier --json "$out/notifier.json" 2>&1 | tee "$out/bench.txt"

echo "== hotloop bench engine, device=cuda"
HOTLOOP_BENCH_DEVICE=cuda timeout 600 hotloop bench engine --plot "$out/engine.png" --json "$out/engine.json" 2>&1 \
  | tee "$out/engine.txt"
exit $status
