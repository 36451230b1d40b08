"""HOTLOOP_VLLM_DEVICE_WAIT (hotloop.vllm.device_wait): a GPU worker's wait for a step's sampled tokens on a hotloop
StepNotifier marked after the output copy on the copy stream, instead of vLLM's CUDA event. Against the fake CUDA
driver (streams emulated by host threads): the wait parks until the copy's work ends, returns then, reports a
failed stream with the driver's message, the event's other attributes still answer, and install() wraps vLLM's
classes only when asked and a driver is there."""

import threading

import pytest

from conftest import thread_sleeping, wait_until
from gpu_backends import FakeGpu
from hotloop import StepError
from hotloop.vllm import device_wait


class RecordedEvent:
    """What vLLM's torch.cuda.Event(blocking=True) is to the code around it: synchronize() and attributes."""

    def __init__(self):
        self.blocking = True
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


class CopyOutput:
    """The shape of vLLM's AsyncGPUModelRunnerOutput: enqueues the copy on the side stream, records an event after
    it, and get_output() synchronizes on that event."""

    def __init__(self, model_runner_output, sampled_token_ids, async_output_copy_stream, vocab_size, gpu=None):
        self.output = model_runner_output
        self.gate = gpu.gated(async_output_copy_stream)  # the copy: runs until the test opens the gate
        self.async_copy_ready_event = RecordedEvent()

    def get_output(self):
        self.async_copy_ready_event.synchronize()
        return self.output


@pytest.fixture
def gpu():
    g = FakeGpu()
    yield g
    g.close()


@pytest.fixture
def wrapped():
    device_wait.wrap_init(CopyOutput)
    yield CopyOutput
    device_wait.uninstall()
    device_wait._local.__dict__.clear()


def test_get_output_parks_until_the_copy_ends(gpu, wrapped):
    stream = gpu.stream()
    out = wrapped("tokens", None, stream, 512, gpu=gpu)
    assert isinstance(out.async_copy_ready_event, device_wait.NotifiedEvent)
    assert out.async_copy_ready_event.blocking is True  # the event's attributes still answer
    assert not out.async_copy_ready_event.query()
    got = []
    t = threading.Thread(target=lambda: got.append(out.get_output()))
    t.start()
    wait_until(lambda: thread_sleeping(t), what="the worker's wait parking")
    assert got == []
    gpu.open(out.gate)
    t.join(timeout=10)
    assert got == ["tokens"] and out.async_copy_ready_event.query()
    assert out.async_copy_ready_event.event.synchronized == 0, "vLLM's event wait ran as well"


def test_a_failed_stream_raises_the_drivers_error(gpu, wrapped):
    stream = gpu.stream()
    gpu.fault(stream)
    out = wrapped("tokens", None, stream, 512, gpu=gpu)
    gpu.open(out.gate)
    with pytest.raises(StepError, match="CUDA_ERROR"):
        out.get_output()
    gpu.fake.reset_error()


def test_steps_complete_in_order_on_one_notifier(gpu, wrapped):
    stream = gpu.stream()
    outs = [wrapped(i, None, stream, 512, gpu=gpu) for i in range(3)]
    assert len({id(o.async_copy_ready_event.notifier) for o in outs}) == 1  # one notifier per thread
    for o in outs:
        gpu.open(o.gate)
    assert [o.get_output() for o in outs] == [0, 1, 2]


def test_a_class_without_the_copy_stream_is_refused():
    class Other:
        def __init__(self, stream):
            pass

    with pytest.raises(RuntimeError, match="async_output_copy_stream"):
        device_wait.wrap_init(Other)


def test_install_wraps_vllms_classes_only_when_asked(monkeypatch):
    pytest.importorskip("vllm")
    runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    real = runner.AsyncGPUModelRunnerOutput.__init__
    monkeypatch.delenv(device_wait.ENV, raising=False)
    assert device_wait.install() is False
    monkeypatch.setenv(device_wait.ENV, "1")
    try:
        assert device_wait.install() is True  # the fake driver is the driver here (conftest)
        assert runner.AsyncGPUModelRunnerOutput.__init__ is not real
        assert "__init__" in runner.AsyncGPUPoolingModelRunnerOutput.__dict__
    finally:
        device_wait.uninstall()
    assert runner.AsyncGPUModelRunnerOutput.__init__ is real
