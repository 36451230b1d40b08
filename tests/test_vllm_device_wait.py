"""HOTLOOP_VLLM_DEVICE_WAIT (hotloop.vllm.device_wait): a GPU worker's wait for a step's sampled tokens on a hotloop
StepNotifier marked after the output copy on the copy stream, instead of vLLM's CUDA event. Against the fake CUDA
driver (streams emulated by host threads), for the output classes of both of vLLM's model runners (V1's and V2's
shapes): the wait parks until the copy's work ends, returns then, reports a failed stream with the driver's
message, the event's other attributes still answer, a class of another shape is refused, and install() wraps
vLLM's classes only when asked and a driver is there, warns naming a runner it cannot cover, and uninstall() puts
them back. vLLM's own pooling output of each runner, run on CPU torch with torch.cuda's stream and event calls
stood in for, parks on the notifier too."""

import contextlib
import logging
import sys
import threading
import types

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


class V1Output:
    """The shape of vLLM's AsyncGPUModelRunnerOutput (Model Runner V1): enqueues the copy on the side stream given
    as async_output_copy_stream, records async_copy_ready_event after it, and get_output() synchronizes on it."""

    EVENT = "async_copy_ready_event"

    def __init__(self, model_runner_output, sampled_token_ids, async_output_copy_stream, vocab_size, gpu=None):
        self.output = model_runner_output
        self.gate = gpu.gated(async_output_copy_stream)  # the copy: runs until the test opens the gate
        self.async_copy_ready_event = RecordedEvent()

    def get_output(self):
        self.async_copy_ready_event.synchronize()
        return self.output

    @classmethod
    def build(cls, output, stream, gpu):
        return cls(output, None, stream, 512, gpu=gpu)  # positional, as a caller may


class V2Output:
    """The shape of vLLM's AsyncOutput (Model Runner V2, vllm/v1/worker/gpu/async_utils.py): the copy on
    copy_stream (after it waits for main_stream), copy_event recorded on copy_stream, synchronized in
    get_output()."""

    EVENT = "copy_event"

    def __init__(self, model_runner_output, sampler_output, num_sampled_tokens, main_stream, copy_stream,
                 check_ep_fault, pending_aux_output, gpu=None):
        self.model_runner_output = model_runner_output
        self.copy_event = RecordedEvent()
        self.gate = gpu.gated(copy_stream)

    def get_output(self):
        self.copy_event.synchronize()
        return self.model_runner_output

    @classmethod
    def build(cls, output, stream, gpu):
        return cls(model_runner_output=output, sampler_output=None, num_sampled_tokens=None, main_stream=0,
                   copy_stream=stream, check_ep_fault=False, pending_aux_output=None, gpu=gpu)  # as vLLM calls it


@pytest.fixture
def gpu():
    g = FakeGpu()
    yield g
    g.close()


@pytest.fixture
def clean():
    yield
    device_wait.uninstall()
    device_wait._local.__dict__.clear()


@pytest.fixture(params=[V1Output, V2Output], ids=["V1", "V2"])
def wrapped(request, clean):
    real = request.param.__init__
    device_wait.wrap_init(request.param)
    assert request.param.__init__ is not real
    yield request.param


def event(out):
    return getattr(out, out.EVENT)


def test_get_output_parks_until_the_copy_ends(gpu, wrapped):
    stream = gpu.stream()
    out = wrapped.build("tokens", stream, gpu)
    assert isinstance(event(out), device_wait.NotifiedEvent)
    assert event(out).blocking is True  # the event's attributes still answer
    assert not event(out).query()
    got = []
    t = threading.Thread(target=lambda: got.append(out.get_output()))
    t.start()
    wait_until(lambda: thread_sleeping(t), what="the worker's wait parking")
    assert got == []
    gpu.open(out.gate)
    t.join(timeout=10)
    assert got == ["tokens"] and event(out).query()
    assert event(out).event.synchronized == 0, "vLLM's event wait ran as well"


def test_a_failed_stream_raises_the_drivers_error(gpu, wrapped):
    stream = gpu.stream()
    gpu.fault(stream)
    out = wrapped.build("tokens", stream, gpu)
    gpu.open(out.gate)
    with pytest.raises(StepError, match="CUDA_ERROR"):
        out.get_output()
    gpu.fake.reset_error()


def test_steps_complete_in_order_on_one_notifier(gpu, wrapped):
    stream = gpu.stream()
    outs = [wrapped.build(i, stream, gpu) for i in range(3)]
    assert len({id(event(o).notifier) for o in outs}) == 1  # one notifier per thread
    for o in outs:
        gpu.open(o.gate)
    assert [o.get_output() for o in outs] == [0, 1, 2]


def test_uninstall_puts_both_runners_classes_back(gpu, clean):
    real = {cls: cls.__init__ for cls in (V1Output, V2Output)}
    for cls in real:
        device_wait.wrap_init(cls)
    device_wait.uninstall()
    assert {cls: cls.__init__ for cls in real} == real and "__init__" in V2Output.__dict__
    out = V2Output.build("tokens", gpu.stream(), gpu)
    assert isinstance(out.copy_event, RecordedEvent)
    gpu.open(out.gate)


class NoStream:
    def __init__(self, stream):
        self.copy_event = RecordedEvent()

    def get_output(self):
        self.copy_event.synchronize()


class OtherEvent:  # V2's stream parameter, but the event is kept under another name
    def __init__(self, copy_stream):
        self.ready = RecordedEvent()

    def get_output(self):
        self.ready.synchronize()


class NoWait:  # V1's stream and event, but get_output() does not wait on it
    def __init__(self, async_output_copy_stream):
        self.async_copy_ready_event = RecordedEvent()

    def get_output(self):
        return None


@pytest.mark.parametrize("cls", [NoStream, OtherEvent, NoWait])
def test_a_class_of_another_shape_is_refused(cls):
    with pytest.raises(RuntimeError, match=rf"{cls.__qualname__} has the shape of no output class .*"
                                           r"async_output_copy_stream.*copy_stream.*unset HOTLOOP_VLLM_DEVICE_WAIT"):
        device_wait.wrap_init(cls)
    assert "__init__" in cls.__dict__ and cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


def _fake_runners(monkeypatch, v1, v2):
    """RUNNERS pointed at modules holding the given classes (None: the module does not exist)."""
    runners = []
    for runner, classes in zip(device_wait.RUNNERS, (v1, v2)):
        module = f"fake_vllm_runner_{runner.name}"
        if classes is None:
            monkeypatch.delitem(sys.modules, module, raising=False)
        else:
            monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**classes))
        runners.append(device_wait.Runner(runner.name, module, tuple(classes or ("A", "B")), runner.stream,
                                          runner.event, runner.select))
    monkeypatch.setattr(device_wait, "RUNNERS", tuple(runners))
    monkeypatch.setenv(device_wait.ENV, "1")


def test_install_covers_both_runners(monkeypatch, caplog, clean):
    v1 = {"Out": type("Out", (V1Output,), {}), "Pool": type("Pool", (V1Output,), {})}
    v2 = {"Out": type("Out", (V2Output,), {}), "Pool": type("Pool", (V2Output,), {})}
    _fake_runners(monkeypatch, v1, v2)
    with caplog.at_level(logging.INFO, logger="vllm.hotloop"):
        assert device_wait.install() is True  # the fake driver is the driver here (conftest)
    assert all("__init__" in cls.__dict__ for cls in (*v1.values(), *v2.values()))
    assert any("Model Runner V1 and V2" in m for m in caplog.messages)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "vllm.hotloop"]
    device_wait.uninstall()
    assert not any("__init__" in cls.__dict__ for cls in (*v1.values(), *v2.values()))


@pytest.mark.parametrize("v2", [{"Out": type("Out", (V2Output,), {}), "Pool": OtherEvent}, None],
                         ids=["another-shape", "no-module"])
def test_install_warns_naming_the_runner_it_cannot_cover(monkeypatch, caplog, clean, v2):
    from hotloop.vllm import vllm_version

    v1 = {"Out": type("Out", (V1Output,), {}), "Pool": type("Pool", (V1Output,), {})}
    _fake_runners(monkeypatch, v1, v2)
    with caplog.at_level(logging.INFO, logger="vllm.hotloop"):
        assert device_wait.install() is True  # V1's classes are covered
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "vllm.hotloop"]
    assert len(warned) == 1, caplog.messages
    assert f"cannot cover vLLM {vllm_version()}'s Model Runner V2" in warned[0]
    assert "VLLM_USE_V2_MODEL_RUNNER=0 puts the workers on Model Runner V1" in warned[0]
    assert all("__init__" in cls.__dict__ for cls in v1.values())
    if v2 is not None:  # none of V2's classes wrapped, not even the one of the right shape
        assert "OtherEvent" in warned[0] and "__init__" not in v2["Out"].__dict__


def test_install_with_no_runner_covered_returns_false(monkeypatch, caplog, clean):
    _fake_runners(monkeypatch, None, None)
    with caplog.at_level(logging.WARNING, logger="vllm.hotloop"):
        assert device_wait.install() is False
    warned = [r.getMessage() for r in caplog.records if r.name == "vllm.hotloop"]
    assert len(warned) == 2 and all(f"unset {device_wait.ENV}" in m for m in warned), warned


def test_install_wraps_vllms_classes_only_when_asked(monkeypatch, caplog):
    pytest.importorskip("vllm")
    v1 = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    v2 = pytest.importorskip("vllm.v1.worker.gpu.async_utils")
    classes = (v1.AsyncGPUModelRunnerOutput, v1.AsyncGPUPoolingModelRunnerOutput, v2.AsyncOutput,
               v2.AsyncPoolingOutput)
    real = [cls.__init__ for cls in classes]
    monkeypatch.delenv(device_wait.ENV, raising=False)
    assert device_wait.install() is False
    monkeypatch.setenv(device_wait.ENV, "1")
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.hotloop"):
            assert device_wait.install() is True  # the fake driver is the driver here (conftest)
        warned = [r.getMessage() for r in caplog.records if r.name == "vllm.hotloop"]
        assert not warned, "the installed vLLM has a runner device_wait cannot cover"
        assert all(cls.__init__ is not r for cls, r in zip(classes, real))
    finally:
        device_wait.uninstall()
    assert [cls.__init__ for cls in classes] == real


class CopyStream:
    """What vLLM's pooling outputs use of a torch.cuda.Stream: wait_stream(), and the handle hotloop marks on."""

    def __init__(self, handle):
        self.cuda_stream = handle

    def wait_stream(self, other):
        pass


class TorchEvent(RecordedEvent):
    def __init__(self, blocking=False):
        super().__init__()
        self.blocking, self.recorded = blocking, 0

    def record(self, stream=None):
        self.recorded += 1


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_vllms_own_pooling_output_waits_on_the_notifier(gpu, monkeypatch, clean, runner):
    """vLLM's pooling output class of each runner, run on CPU torch with torch.cuda's stream and event calls stood
    in for: install() wraps it, its get_output() parks on the notifier until the copy stream's work ends."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if runner == "V1":
        cls = pytest.importorskip("vllm.v1.worker.gpu_model_runner").AsyncGPUPoolingModelRunnerOutput
    else:
        cls = pytest.importorskip("vllm.v1.worker.gpu.async_utils").AsyncPoolingOutput
    monkeypatch.setattr(torch.cuda, "Event", TorchEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setenv(device_wait.ENV, "1")
    assert device_wait.install() is True
    stream = gpu.stream()
    gate = gpu.gated(stream)  # the copy, enqueued before vLLM records its event
    result, pooled = types.SimpleNamespace(pooler_output=None), torch.arange(4.0).reshape(1, 4)
    if runner == "V1":
        out = cls(model_runner_output=result, raw_pooler_output=pooled, finished_mask=[True],
                  async_output_copy_stream=CopyStream(stream))
        ev = out.async_copy_ready_event
    else:
        out = cls(model_runner_output=result, pooler_output=pooled, finished_mask=[True], main_stream=None,
                  copy_stream=CopyStream(stream))
        ev = out.copy_event
    assert isinstance(ev, device_wait.NotifiedEvent) and ev.blocking and ev.recorded == 1
    got = []
    t = threading.Thread(target=lambda: got.append(out.get_output()))
    t.start()
    wait_until(lambda: thread_sleeping(t), what="vLLM's get_output() parking on the notifier")
    assert got == []
    gpu.open(gate)
    t.join(timeout=10)
    assert got == [result] and ev.event.synchronized == 0
    assert torch.equal(torch.stack(list(result.pooler_output)).reshape(1, 4), pooled)
    device_wait.uninstall()
    assert "__init__" in cls.__dict__ and cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
