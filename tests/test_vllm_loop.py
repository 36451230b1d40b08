"""vLLM's engine core on hotloop's engine-core loop (HOTLOOP_VLLM_LOOP=1, ``hotloop/vllm/engine_loop.py``): inputs
that arrive while a step runs are handled during that step (a new request reaches the scheduler, a utility call
answers, a waiting and a running request are aborted, as vLLM ends them), greedy outputs stay those of vLLM's own
loop, a worker killed during a step surfaces EngineDeadError, a shutdown during a step ends every process.

Each case drives AsyncLLM (TP=1, multiprocess executor) in a child process (``vllm_loop_driver.py``) whose worker
sleeps STEP_S before each step, so "during a step" is a wide window; the control arm runs the same driver on
vLLM's own loop and queue and shows the waits the loop removes. Needs vLLM (``pip install "hotloop[vllm]"``).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from conftest import require_supported_vllm

require_supported_vllm()

from hotloop.vllm import tiny_model  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from vllm_loop_driver import STEP_S  # noqa: E402

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_loop_driver.py")


class _Run:
    """One driver process (``vllm_loop_driver.py``), its output read once it has ended."""

    def __init__(self, model: str, ending: str, *, queue: bool, loop: bool):
        env = dict(os.environ, HOTLOOP_VLLM="1" if queue else "0", HOTLOOP_VLLM_LOOP="1" if loop else "0",
                   HOTLOOP_VLLM_TIMELINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0",
                   VLLM_ALLOW_INSECURE_SERIALIZATION="1", TOKENIZERS_PARALLELISM="false")
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, DRIVER, model, ending], stdout=self.out, stderr=self.err,
                                     text=True, env=env, start_new_session=True)

    def finish(self) -> tuple[int, str, str]:
        """Wait for the driver (killing its session after 400 s); its exit code, stdout and stderr."""
        try:
            self.proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        out, err = [(f.seek(0), f.read(), f.close())[1] for f in (self.out, self.err)]
        return self.proc.returncode, out, err


def _result(runs: dict, name: str) -> dict:
    """Run `name`'s JSON line; fails the test with the driver's log if it did not print one."""
    code, out, err = runs[name]
    assert code == 0 and out.strip(), err[-6000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model():
    return tiny_model.build(0)


@pytest.fixture(scope="module")
def runs(model):
    """The three engines, run at once: the control, vLLM's own queue and loop; and hotloop's loop twice, one ended
    by a shutdown during a step, one by a worker killed during a step. One run alone keeps about a quarter of two
    cores busy (about 45 CPU seconds in 90 s: imports, vLLM's start-up waits, steps slowed on purpose), so the
    three together take little longer than one. Each run's timings are within its own engine (a request's queue
    wait, a utility call's answer, the time from the kill to the error), bounded well above what the others'
    work costs them."""
    started = {"vllms_own": _Run(model, "shutdown", queue=False, loop=False),
               "shutdown": _Run(model, "shutdown", queue=True, loop=True),
               "kill": _Run(model, "kill", queue=True, loop=True)}
    return {name: run.finish() for name, run in started.items()}


@pytest.fixture(scope="module")
def vllms_own(runs):
    """The control: vLLM's own queue and loop, same driver."""
    return _result(runs, "vllms_own")


def _waits_by_request(res: dict) -> dict:
    """request name (vLLM adds a suffix to the id) -> (queue wait us, taken during a step)"""
    w = res["waits"]
    return {rid.split("-")[0]: (us, during) for rid, us, during in zip(w["request_ids"], w["waits_us"],
                                                                       w["during_step"])}


def _check_inputs_during_steps(res: dict, reference: dict) -> None:
    # greedy outputs: vLLM's own loop's, before, during and after the inputs handled in steps
    assert res["reference"] == reference["reference"]
    assert [t for t, _ in res["a_b"]] == reference["reference"][:2]
    assert [why for _, why in res["a_b"]] == ["length", "length"]
    assert res["after"] == reference["reference"]
    # a utility call made during a step is answered during it, not at its end
    assert res["utility_in_step"] is True
    assert res["utility_s"] < STEP_S / 2, res["utility_s"]
    # requests that arrived during a step (B, and C, aborted later) went into the scheduler during it, within
    # microseconds rather than at the step's end
    waits = _waits_by_request(res)
    assert waits["B"][1] and waits["C"][1], waits
    assert max(waits["B"][0], waits["C"][0]) < STEP_S / 2 * 1e6, waits
    # aborts during a step: the running request stops at once and the waiting one never runs; the scheduler
    # holds nothing afterwards
    assert res["after_aborts_in_step"] is True
    assert res["A2_end"][1] == "abort" and len(res["A2_end"][0]) < 8, res["A2_end"]
    assert res["C_end"] == [[], "abort"], res["C_end"]
    assert res["unfinished_after"] == 0
    assert res["inputs_in_step"] >= 5  # B's add, the utility calls, C's add, two aborts
    # the loop sends the step's outputs from the engine core's main thread (output_send.py): with a step every
    # STEP_S, nothing is ever queued ahead of an output, so none waits for vLLM's output thread
    assert res["outputs"]["direct"] >= 8 and res["outputs"]["queued"] <= 2, res["outputs"]
    # and the engine core's main thread read every input from the front end's socket itself (input_read.py): the
    # adds, aborts and utility calls above, at least 12 messages, none through vLLM's input thread
    assert res["inputs_read_by_main"] >= 12, res["inputs_read_by_main"]


def test_vllms_own_loop_waits_for_the_step(vllms_own):
    """The control shows what the loop removes: inputs wait for the running step to end."""
    assert [t for t, _ in vllms_own["a_b"]] == vllms_own["reference"][:2]
    assert vllms_own["after"] == vllms_own["reference"]
    assert vllms_own["utility_s"] > STEP_S / 4, vllms_own["utility_s"]
    waits = _waits_by_request(vllms_own)
    assert min(waits["B"][0], waits["C"][0]) > STEP_S / 4 * 1e6, waits
    assert not any(during for _, during in waits.values())


def test_inputs_are_handled_during_a_step_and_a_shutdown_during_a_step_ends_everything(runs, vllms_own):
    res = _result(runs, "shutdown")
    _check_inputs_during_steps(res, vllms_own)
    assert set(res["tree"].values()) == {"VLLM::EngineCore", "VLLM::Worker"}, res["tree"]
    assert res["left"] == [], res
    # vLLM's own shutdown with a step in flight (abort mode, then its 5 s wait for the engine core): no longer
    assert res["shutdown_s"] <= vllms_own["shutdown_s"] + 2, (res["shutdown_s"], vllms_own["shutdown_s"])


def test_a_worker_killed_during_a_step_surfaces_engine_dead_error(runs, vllms_own):
    res = _result(runs, "kill")
    _check_inputs_during_steps(res, vllms_own)
    assert res["kill"] == "EngineDeadError", res
    assert res["kill_to_error_s"] < 10, res["kill_to_error_s"]
    assert res["left"] == [], res
