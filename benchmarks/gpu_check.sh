#!/usr/bin/env bash
# The GPU check (about 6 minutes, plus step 5's second model runner, on a machine with an NVIDIA GPU), one command:
# bash benchmarks/gpu_check.sh
#   1. the StepNotifier tests and the engine's notifier tests (device="cuda": identical outputs in every wait mode
#      and executor) against the real driver;
#   2. `hotloop bench notifier`: kernel end -> waiter back in Python and CPU while waiting, each mechanism next to
#      torch.cuda.Event.synchronize() and a Python event.query() spin;
#   3. `hotloop bench engine` with device="cuda": block / poll / hotloop, in-process and multiproc, model "small":
#      throughput, TTFT / ITL, queue wait, CPU per token and idle CPU;
#   4. where vLLM's CUDA build is installed (0.30-0.33; `pip install vllm==0.33.0` before, this machine may have
#      no network): hotloop.vllm.source_check on it, then the tiny Llama at TP=1 on vLLM's own queue, on
#      hotloop's and with hotloop's engine-core loop (greedy tokens must be equal), then `hotloop bench vllm`'s
#      short run at TP=1 (the step on the GPU: the engine core's CPU is free while it runs). Skipped, saying so,
#      without vLLM.
#   5. (with vLLM) the worker's wait for its sampled tokens: hotloop's queue at TP=1, decoding 16 requests of 256
#      tokens, with and without HOTLOOP_VLLM_DEVICE_WAIT=1 (hotloop.vllm.device_wait), 3 rounds alternating, on
#      each of vLLM's GPU model runners: V2 (vLLM's default where Triton is installed; set here with
#      VLLM_USE_V2_MODEL_RUNNER=1, so a fallback cannot measure V1 twice) and V1 (VLLM_USE_V2_MODEL_RUNNER=0): the
#      worker's and the engine core's host CPU (percent of a core over the run), tok/s, tokens equal per runner.
# Prints everything; writes build/gpu-check/* (tests-*.txt, notifier.json, bench.txt, engine.json, engine.txt,
# engine.png, vllm-source.txt, vllm-tokens.txt, vllm.json, vllm.txt, vllm.png, vllm-device-wait.txt). Exits 2 at once with no usable
# GPU, 1 if a test failed.
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

echo "== vLLM on hotloop, on the GPU"
if ! python3 -c "import vllm" >/dev/null 2>&1; then
  echo "(skipped: vLLM does not import here; pip install vllm==0.33.0, or another release 0.30-0.33, to run it)"
  exit $status
fi
python3 -m hotloop.vllm.source_check 2>&1 | tee "$out/vllm-source.txt" | head -1
[ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; grep FAIL "$out/vllm-source.txt"; }
# greedy tokens of the three arms at TP=1 (the Driver of `hotloop bench vllm`: a tiny Llama, one process per arm)
timeout 600 python3 - <<'PY' 2>&1 | tee "$out/vllm-tokens.txt" | tail -6
import sys
from hotloop.bench.vllm.driver import Driver
from hotloop.vllm import tiny_model, vllm_version

if __name__ == "__main__":
    model, tokens = tiny_model.build(0), {}
    for arm in ("vllm", "hotloop", "hotloop+loop"):
        d = Driver(1, arm, model)
        try:
            out = d.generate(4, max_tokens=32)
            tokens[arm] = out.get("token_ids") or out
            print(f"vLLM {vllm_version()} {arm}: queue {d.queue_class}, {out.get('wall_s', 0):.3f} s, "
                  f"error {out.get('error')}")
        finally:
            left = d.close()
            print(f"  left behind: {left or 'nothing'}")
    same = tokens["vllm"] == tokens["hotloop"] == tokens["hotloop+loop"]
    print("greedy tokens equal in the three arms" if same else f"TOKENS DIFFER: {tokens}")
    sys.exit(0 if same else 1)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 900 python3 -m hotloop.bench.vllm.offline --quick --tp-sizes 1 --json "$out/vllm.json" --plot "$out/vllm.png" \
  2>&1 | tee "$out/vllm.txt" | tail -40
echo "== vLLM's worker: its sampled tokens waited for on a CUDA event (vLLM) or a hotloop StepNotifier"
timeout 1800 python3 - <<'PY' 2>&1 | tee "$out/vllm-device-wait.txt" | tail -16
import statistics, sys, time
from hotloop.bench.vllm.driver import Driver
from hotloop.bench.vllm.processes import cpu_by_process
from hotloop.vllm import tiny_model

RUNNERS = (("V2", "1"), ("V1", "0"))  # vLLM's Model Runner, VLLM_USE_V2_MODEL_RUNNER

if __name__ == "__main__":
    model, differ = tiny_model.build(0), []
    for runner, flag in RUNNERS:
        rows, tokens = {"event": [], "notifier": []}, {}
        for rnd in range(3):
            for arm in (("event", "notifier") if rnd % 2 == 0 else ("notifier", "event")):
                d = Driver(1, "hotloop", model, {"HOTLOOP_VLLM_DEVICE_WAIT": "1" if arm == "notifier" else "0",
                                                 "VLLM_USE_V2_MODEL_RUNNER": flag})
                try:
                    d.generate(4, max_tokens=16)  # warm-up
                    k0, t0 = cpu_by_process(d.pid), time.monotonic()
                    out = d.generate(16, max_tokens=256)
                    span, k1 = time.monotonic() - t0, cpu_by_process(d.pid)
                    pct = {k: 100 * (k1[k] - k0.get(k, 0)) / span for k in k1}
                    rows[arm].append((pct.get("worker0", 0), pct.get("engine_core", 0), 16 * 256 / out["wall_s"]))
                    tokens.setdefault(arm, out["token_ids"])
                finally:
                    d.close()
        for arm, r in rows.items():
            print(f"{runner} {arm:9s} worker CPU {statistics.median(x[0] for x in r):5.1f} %  engine core "
                  f"{statistics.median(x[1] for x in r):5.1f} %  {statistics.median(x[2] for x in r):7.0f} tok/s  "
                  f"(median of {len(r)}; runs {[round(x[0]) for x in r]})")
        same = tokens["event"] == tokens["notifier"]
        print(f"{runner}: greedy tokens equal" if same else f"{runner}: TOKENS DIFFER")
        differ += [] if same else [runner]
    sys.exit(1 if differ else 0)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
