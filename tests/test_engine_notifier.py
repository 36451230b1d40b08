"""The engine's steps complete through a step notifier: HostStepNotifier on the CPU; hotloop.cuda.StepNotifier on
CUDA, exercised here on the fake driver (the engine-facing part: launch -> mark on a stream -> the loop waits on
until(token) with its inputs -> tokens read once done; torch's own CUDA tensors need a real GPU) and, when
HOTLOOP_TEST_CUDA=real (benchmarks/gpu_check.sh) on a machine with a GPU, end to end with device="cuda"."""

import threading
import time

import pytest
from conftest import require_torch

torch = require_torch()

import hotloop  # noqa: E402
import hotloop.cuda  # noqa: E402
from conftest import CUDA_BACKEND, wait_until  # noqa: E402
from hotloop.engine import AddRequest, EngineCore, ExecutorError  # noqa: E402
from hotloop.engine import tokenizer as tk  # noqa: E402
from hotloop.engine.device import cuda_problem, resolve_device  # noqa: E402
from hotloop.engine.executors.inprocess import InProcessExecutor  # noqa: E402
from hotloop.engine.model_runner import ModelRunner  # noqa: E402
from hotloop.engine.model import model_config  # noqa: E402

MODES = ("block", "poll", "hotloop")
SPECS = [AddRequest(f"r{i}", tk.encode(f"request {i}: " + "xy" * i), 6 + i, temperature=0.7 if i == 2 else 0.0,
                    seed=i) for i in range(4)]


def _collect(core: EngineCore, specs, during=None):
    """Run the core in a thread, feed `specs`, gather {id: (tokens, reason, error)} until every one finished.
    Returns (outputs, the ExecutorError run() raised or None)."""
    raised = []

    def run():
        try:
            core.run()
        except ExecutorError as e:
            raised.append(e)

    t = threading.Thread(target=run)
    t.start()
    for spec in specs:
        core.input_queue.put(spec)
    if during:
        during(core)
    got, done = {}, set()
    try:
        while len(done) < len(specs):
            for o in core.output_queue.get(timeout=60):
                toks, _, _ = got.get(o.request_id, ([], None, None))
                got[o.request_id] = (toks + o.new_token_ids, o.finish_reason, o.error)
                if o.finished:
                    done.add(o.request_id)
    finally:
        core.input_queue.put(None)
        t.join(30)
    assert not t.is_alive(), "the engine loop did not stop"
    return got, (raised[0] if raised else None)


@pytest.fixture(scope="module")
def reference():
    got, err = _collect(EngineCore("tiny", wait_mode="block", max_tokens_per_step=24), SPECS)
    assert err is None
    return got


# ---- CPU: HostStepNotifier ----


@pytest.mark.parametrize("mode", MODES)
def test_in_process_steps_complete_through_the_host_step_notifier(mode, reference):
    core = EngineCore("tiny", wait_mode=mode, max_tokens_per_step=24)
    assert core.device == "cpu" and isinstance(core.executor.notifier, hotloop.HostStepNotifier)
    got, err = _collect(core, SPECS)
    assert err is None and got == reference
    assert core.stats.steps > 0
    assert core.stats.notifier_completions == core.stats.steps  # every step ended through the notifier
    assert core.executor.notifier.issued == core.stats.steps


def test_hotloop_waits_on_the_step_and_the_inputs_in_one_wait():
    core = EngineCore("tiny", wait_mode="hotloop", step_delay_s=0.3)

    def late(core):
        # the first step (0.3 s) is in flight and the loop parked on {the step, the inputs}
        wait_until(lambda: core.executor.in_flight and core.input_queue.parked, what="the engine loop parking")
        core.input_queue.put(AddRequest("late", [1, 2, 3], 2, arrival_ns=time.monotonic_ns()))

    got, err = _collect(core, [AddRequest("first", [1, 2], 2)], during=late)
    assert err is None
    assert core.stats.added_during_step == 1 and max(core.stats.queue_wait_ns) < 50e6
    assert core.stats.notifier_completions == core.stats.steps


class _FailingRunner:
    """A CPU runner whose step number `fail_at` raises (as a model that hits a bad state would)."""

    def __init__(self, fail_at: int):
        self.inner = ModelRunner(model_config("tiny"))
        self.device, self.notifier = "cpu", None
        self.fail_at, self.steps = fail_at, 0

    def launch(self, out):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("injected: device state lost")
        return self.inner.launch(out)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_step_fails_every_request_and_the_engine_stops(mode):
    executor = InProcessExecutor(model_config("tiny"), runner=_FailingRunner(fail_at=3))
    core = EngineCore("tiny", executor=executor, wait_mode=mode)
    got, err = _collect(core, SPECS)
    assert isinstance(err, ExecutorError) and "injected: device state lost" in str(err)
    assert set(got) == {s.request_id for s in SPECS}
    for toks, reason, error in got.values():
        assert reason == "engine_dead"
        assert "step 3 failed" in error and "the model raised in the in-process worker" in error
        assert "RuntimeError('injected: device state lost')" in error
    assert executor.notifier.issued == executor.notifier.completed == 3  # the failed step is done: nobody hangs


def test_resolve_device_names_what_to_change():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if cuda_problem() is None else "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
    if cuda_problem() is not None:
        with pytest.raises(ValueError, match="cannot be used: .*use device='cpu'"):
            EngineCore("tiny", device="cuda")
    from hotloop.engine.executors.multiproc import MultiprocExecutor

    with pytest.raises(ValueError, match="device='cpu' only"):  # refused before any worker starts
        MultiprocExecutor(model_config("tiny"), 1, step_delay_s=0.1, device="cuda")


# ---- CUDA on the fake driver: the engine-facing part of device="cuda" ----

fake_only = pytest.mark.skipif(CUDA_BACKEND != "fake", reason="uses the fake CUDA driver (HOTLOOP_TEST_CUDA=fake)")


class _Step:
    """What InProcessExecutor reads from a launch: the notifier token, and tokens() that may only be called once
    the stream passed it (checked here)."""

    def __init__(self, notifier, token, tokens):
        self.notifier, self.token, self._tokens = notifier, token, tokens

    def tokens(self):
        assert self.notifier.done(self.token), "the engine read a step's tokens before its notifier said done"
        return self._tokens


class _FakeGpuRunner:
    """device="cuda" as the executor sees it, on the fake driver: each step's tokens are computed on the CPU (so
    outputs must equal the CPU reference), then the step's "kernels" are enqueued on a fake stream and the
    notifier is marked after them, as ModelRunner does after its device-to-host copies. `kernel(stream, step)`
    enqueues step `step`'s work."""

    def __init__(self, gpu, kernel):
        self.cpu = ModelRunner(model_config("tiny"))
        self.gpu, self.kernel = gpu, kernel
        self.stream = gpu.stream()
        self.notifier = hotloop.cuda.StepNotifier()  # the fake context is current on this (the test's) thread
        self.device, self.steps = "cuda", 0

    def launch(self, out):
        tokens = self.cpu.launch(out).tokens()
        self.steps += 1
        self.kernel(self.stream, self.steps)
        return _Step(self.notifier, self.notifier.mark(self.stream), tokens)


@pytest.fixture
def fake_gpu():
    from gpu_backends import FakeGpu

    g = FakeGpu()
    yield g
    g.close()


@fake_only
@pytest.mark.parametrize("mode", MODES)
def test_cuda_path_on_the_fake_driver_gives_the_same_outputs(mode, fake_gpu, reference):
    runner = _FakeGpuRunner(fake_gpu, lambda stream, step: fake_gpu.sleep(stream, 0.002))
    core = EngineCore("tiny", executor=InProcessExecutor(model_config("tiny"), runner=runner), wait_mode=mode,
                      max_tokens_per_step=24)
    assert isinstance(core.executor.notifier, hotloop.cuda.StepNotifier)
    got, err = _collect(core, SPECS)
    assert err is None and got == reference
    assert core.stats.notifier_completions == core.stats.steps == runner.steps


@fake_only
def test_cuda_path_hotloop_takes_inputs_while_the_stream_runs(fake_gpu):
    gates = []

    def kernel(stream, step):
        if step == 1:
            gates.append(fake_gpu.gated(stream))  # the first step runs until the test opens its gate

    runner = _FakeGpuRunner(fake_gpu, kernel)
    core = EngineCore("tiny", executor=InProcessExecutor(model_config("tiny"), runner=runner), wait_mode="hotloop")

    def during(core):
        wait_until(lambda: gates, what="the first step's kernel starting")
        # the loop parked on {the stream, the inputs} while the kernel runs
        wait_until(lambda: core.executor.in_flight and core.input_queue.parked, what="the engine loop parking")
        assert core.stats.steps == 0  # the step is not done while its kernel runs
        core.input_queue.put(AddRequest("late", [5, 6], 2, arrival_ns=time.monotonic_ns()))
        # taken while the loop waited for the stream: the gate is still shut, so no step can have ended first
        wait_until(lambda: core.stats.added_during_step == 1, what="the late request taken during the step")
        assert core.stats.steps == 0
        fake_gpu.open(gates[0])

    got, err = _collect(core, [AddRequest("first", [1, 2], 3)], during=during)
    assert err is None and got["first"][1] == got["late"][1] == "length"
    assert core.stats.notifier_completions == core.stats.steps


@fake_only
@pytest.mark.parametrize("mode", MODES)
def test_cuda_fault_fails_every_request_with_the_drivers_message(mode, fake_gpu):
    def kernel(stream, step):
        if step == 2:
            fake_gpu.fault(stream)

    runner = _FakeGpuRunner(fake_gpu, kernel)
    core = EngineCore("tiny", executor=InProcessExecutor(model_config("tiny"), runner=runner), wait_mode=mode)
    got, err = _collect(core, SPECS)
    assert isinstance(err, ExecutorError) and "CUDA_ERROR_ILLEGAL_ADDRESS" in str(err)
    assert all(r == "engine_dead" and "CUDA_ERROR_ILLEGAL_ADDRESS" in e for _, r, e in got.values())


# ---- a real GPU (HOTLOOP_TEST_CUDA=real) ----

real_gpu = pytest.mark.skipif(CUDA_BACKEND != "real" or cuda_problem() is not None,
                              reason="needs a GPU and HOTLOOP_TEST_CUDA=real (benchmarks/gpu_check.sh)")


def _run_cuda(executor, mode):
    core = EngineCore("tiny", executor=executor, wait_mode=mode, max_tokens_per_step=24, device="cuda")
    got, err = _collect(core, SPECS)
    assert err is None
    if executor == "inprocess":
        assert isinstance(core.executor.notifier, hotloop.cuda.StepNotifier)
        assert core.stats.notifier_completions == core.stats.steps > 0
    return got


@pytest.fixture(scope="module")
def cuda_reference():
    """The in-process block run on CUDA; module-scoped, so the CUDA context, the driver's descriptors and its
    callback thread (kept for the process's life) exist before the per-test leak check looks."""
    return _run_cuda("inprocess", "block")


@real_gpu
@pytest.mark.parametrize("executor,mode", [("inprocess", "poll"), ("inprocess", "hotloop"),
                                           ("multiproc", "hotloop"), ("multiproc", "block")])
def test_device_cuda_outputs_are_identical_across_modes_and_executors(executor, mode, cuda_reference):
    assert all(reason == "length" for _, reason, _ in cuda_reference.values())
    assert _run_cuda(executor, mode) == cuda_reference
