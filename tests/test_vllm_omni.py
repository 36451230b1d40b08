"""vllm-omni 0.30.0's own two-stage text pipeline with hotloop in every stage (``hotloop.vllm.omni``): greedy
outputs identical on hotloop's queue (vllm-omni's event-driven orchestrator) and on vLLM's own (its default polling
loop), and the plugin's line logged by every stage's engine core and worker on hotloop's queue, by none on vLLM's.

Needs vllm-omni 0.30.0 next to vLLM 0.30 (``scripts/install_vllm_omni.sh``, docs/vllm.md); skipped otherwise (the
main CI venv runs a vLLM that vllm-omni 0.30.0 does not import on). vllm-omni runs in child processes
(``python -m hotloop.bench.vllm.omni --driver``), never in the test process; each pipeline start imports vllm-omni in
five processes (about 1.5-2 min on 2 cores).
"""

import os

import pytest

from hotloop.vllm import omni

PLUGIN_LINE = ("(StageEngineCoreProc_stage0_replica0 pid=23487) INFO 12-01 20:05:09 [__init__.py:156] hotloop: vLLM "
               "0.30.0 runs on hotloop's MessageQueue (shared-memory ring, GIL-free spin/yield/park waits) in process "
               "23487; patched 2 module(s)")


def _require_vllm_omni():
    from conftest import require_supported_vllm

    require_supported_vllm()
    from hotloop.vllm import vllm_version

    # HOTLOOP_TEST_REQUIRE_OMNI=1 (scripts/test_vllm_versions.sh, where it is installed): fail instead of skipping
    skip = pytest.fail if os.environ.get("HOTLOOP_TEST_REQUIRE_OMNI") == "1" else pytest.skip
    if omni.vllm_omni_version() is None:
        skip("vllm-omni is not installed (scripts/install_vllm_omni.sh installs 0.30.0 for text stages)")
    if not vllm_version().startswith("0.30."):
        skip(f"vllm-omni {omni.vllm_omni_version()} needs vLLM 0.30; this is vLLM {vllm_version()}")


def test_plugin_lines_are_read_per_process():
    log = "\n".join([PLUGIN_LINE, PLUGIN_LINE.replace("23487", "23499"), "INFO other line in process 1"])
    assert omni.stage_processes_on_hotloop(log) == {23487: "0.30.0", 23499: "0.30.0"}


def test_deploy_file_runs_every_stage_on_vllms_cpu_worker(tmp_path):
    path = omni.write_deploy_yaml(str(tmp_path / "deploy.yaml"), "hotloop_text2", 2, bind=["0", "1"])
    text = open(path).read()
    assert text.startswith("pipeline: hotloop_text2\n")
    assert text.count("worker_cls: vllm.v1.worker.cpu_worker.CPUWorker") == 2
    assert 'VLLM_CPU_OMP_THREADS_BIND: "0"' in text and 'VLLM_CPU_OMP_THREADS_BIND: "1"' in text
    assert "distributed_executor_backend: mp" in text  # each stage's worker in its own process, over the queue


def test_env_switches_hotloop_and_the_event_driven_loop():
    e = omni.env(hotloop=True, event_driven=False, base={})
    assert e["HOTLOOP_VLLM"] == "1" and e[omni.EVENT_DRIVEN_ENV] == "0"
    e = omni.env(hotloop=False, event_driven=True, base={"PYTHONPATH": "/x"})
    assert e["HOTLOOP_VLLM"] == "0" and e[omni.EVENT_DRIVEN_ENV] == "1"
    assert e["PYTHONPATH"].endswith("/x")


def test_two_stage_pipeline_identical_outputs_and_every_stage_on_hotloop():
    _require_vllm_omni()
    from hotloop.bench.vllm.omni import check_arm, run_arm
    from hotloop.vllm import tiny_model

    model = tiny_model.build(0)
    runs = {arm: run_arm(arm, model, requests=3, tokens=8, seed=0) for arm in ("event+hotloop", "legacy")}
    ids = {arm: r["token_ids"] for arm, r in runs.items()}
    assert ids["event+hotloop"] == ids["legacy"]
    assert len(ids["legacy"]) == 3 and all(len(t) == 8 for t in ids["legacy"]), ids["legacy"]
    hot = runs["event+hotloop"]
    kinds = hot["kinds"]
    stage_procs = {pid for pid, k in kinds.items() if k in ("engine_cores", "workers")}
    assert sorted(kinds[p] for p in stage_procs) == ["engine_cores"] * 2 + ["workers"] * 2, kinds
    assert stage_procs <= set(hot["on_hotloop"]), (kinds, hot["on_hotloop"])
    assert check_arm("event+hotloop", hot) == ""
    assert runs["legacy"]["on_hotloop"] == {} and check_arm("legacy", runs["legacy"]) == ""
    from conftest import wait_until

    for r in runs.values():  # every stage process is gone once the driver has returned
        procs = [p for p, k in r["kinds"].items() if k in ("engine_cores", "workers")]
        wait_until(lambda: not [p for p in procs if os.path.exists(f"/proc/{p}")], 10, "the stage processes' exit")
