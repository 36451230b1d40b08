"""hotloop.cuda.StepNotifier from Python, with both mechanisms: on the fake driver, or the real one when
HOTLOOP_TEST_CUDA=real (benchmarks/gpu_check.sh). Loader failures are checked in fresh processes."""

import os
import subprocess
import sys
import threading
import time

import pytest

import hotloop
import hotloop.cuda
from conftest import CUDA_BACKEND
from gpu_backends import FakeGpu, RealGpu
from hotloop import InputQueue, WaitPolicy, wait_any

PARK_AT_ONCE = WaitPolicy(spin_us=0, yield_us=0)


@pytest.fixture(scope="module")
def _real_gpu():
    """A real GPU's driver state, set up once before any test's leak snapshot: the driver opens descriptors
    (and threads) on first use of a context and of each completion mechanism, and keeps them for the process."""
    if CUDA_BACKEND != "real":
        yield None
        return
    reason = hotloop.cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(f"HOTLOOP_TEST_CUDA=real but no usable CUDA driver: {reason}")
    g = RealGpu()
    s = g.stream()
    for mechanism in hotloop.cuda.MECHANISMS:
        n = hotloop.cuda.StepNotifier(mechanism)
        assert n.wait(n.mark(s), timeout=10)
    yield g
    g.close()


@pytest.fixture
def gpu(_real_gpu):
    if _real_gpu is not None:
        yield _real_gpu
        _real_gpu.close()  # synchronizes: nothing of this test runs on into the next
        return
    g = FakeGpu()
    yield g
    g.close()


@pytest.fixture(params=hotloop.cuda.MECHANISMS)
def mechanism(request):
    return request.param


def test_tokens_complete_in_order_once_their_kernels_end(gpu, mechanism):
    n = hotloop.cuda.StepNotifier(mechanism)
    s = gpu.stream()
    g1 = gpu.gated(s)
    t1 = n.mark(s)
    g2 = gpu.gated(s)
    t2 = n.mark(s)
    assert t2 == t1 + 1
    assert not n.done(t1) and not n.done(t2)
    assert n.in_flight == 2
    gpu.open(g2)
    assert n.wait(t1, timeout=0.02) is False
    gpu.open(g1)
    assert n.wait(t2, timeout=10, policy=PARK_AT_ONCE) is True
    assert n.done(t1)
    assert (n.issued, n.completed, n.in_flight) == (2, 2, 0)
    assert n.mechanism == mechanism


def test_wait_wakes_when_the_kernel_ends_and_times_out_while_it_runs(gpu, mechanism):
    n = hotloop.cuda.StepNotifier(mechanism)
    s = gpu.stream()
    gpu.sleep(s, 0.05)
    t = n.mark(s)
    t0 = time.monotonic()
    assert n.wait(t, timeout=0.005) is False
    assert n.wait(t, timeout=10, policy=PARK_AT_ONCE) is True
    assert 0.04 <= time.monotonic() - t0 < 5


def test_wait_any_over_an_input_queue_and_a_step(gpu, mechanism):
    n, q = hotloop.cuda.StepNotifier(mechanism), InputQueue()
    s = gpu.stream()
    gate = gpu.gated(s)
    step = n.until(n.mark(s))
    t = threading.Timer(0.02, lambda: q.put("request"))
    t.start()
    assert wait_any([step, q], timeout=10, policy=PARK_AT_ONCE) == [q]
    t.join()
    q.get_nowait()
    gpu.open(gate)
    assert wait_any([step, q], timeout=10, policy=PARK_AT_ONCE) == [step]


def test_many_marks_in_flight(gpu, mechanism):
    n = hotloop.cuda.StepNotifier(mechanism, max_in_flight=8)
    s = gpu.stream()
    tokens = []
    for _ in range(50):
        gate = gpu.gated(s) if gpu.name == "fake" else gpu.sleep(s, 0.0005)
        tokens += [n.mark(s) for _ in range(8)]
        if gpu.name == "fake":
            with pytest.raises(ValueError, match="already in flight"):
                n.mark(s)
            gpu.open(gate)
        assert n.wait(tokens[-1], timeout=10)
    assert tokens == list(range(tokens[0], tokens[0] + len(tokens)))
    assert all(n.done(t) for t in tokens)


def test_torch_style_stream_objects_are_accepted(gpu):
    class StreamLike:  # what torch.cuda.Stream offers
        def __init__(self, handle):
            self.cuda_stream = handle

    n = hotloop.cuda.StepNotifier()
    t = n.mark(StreamLike(gpu.stream()))
    assert n.wait(t, timeout=10)
    with pytest.raises(TypeError, match="cuda_stream"):
        n.mark("stream 0")


def test_a_notifier_dropped_with_marks_in_flight_is_safe(gpu, mechanism):
    s = gpu.stream()
    gate = gpu.gated(s)
    n = hotloop.cuda.StepNotifier(mechanism)
    for _ in range(8):
        n.mark(s)
    del n
    gpu.open(gate)
    n2 = hotloop.cuda.StepNotifier(mechanism)
    assert n2.wait(n2.mark(s), timeout=10)


def test_bad_input_gets_clear_errors(gpu, mechanism):
    n = hotloop.cuda.StepNotifier(mechanism)
    if gpu.name != "real":  # a real driver dereferences a stream handle unchecked: a bad one is a crash there
        with pytest.raises(hotloop.CudaError, match="not a usable CUDA stream: CUDA_ERROR_INVALID_HANDLE"):
            n.mark(0xDEAD0)
        assert n.issued == 0
    t = n.mark(gpu.stream())
    other = hotloop.cuda.StepNotifier(mechanism)
    with pytest.raises(ValueError, match="not issued by this notifier"):
        other.done(t)
    with pytest.raises(ValueError, match="has issued only 1"):
        n.done(t + 1)  # a token in the future
    with pytest.raises(ValueError, match="unknown completion mechanism 'host_func'"):
        hotloop.cuda.StepNotifier("host_func")
    assert n.wait(t, timeout=10)


def test_a_cuda_error_in_a_step_fails_it_with_the_drivers_message(gpu, mechanism):
    if not gpu.can_fault:
        pytest.skip("a faulting kernel would poison the real context for the rest of the run")
    n = hotloop.cuda.StepNotifier(mechanism)
    s = gpu.stream()
    ok = n.mark(s)
    assert n.wait(ok, timeout=10)
    gate = gpu.gated(s)  # the mark is enqueued before the fault happens
    gpu.fault(s)
    bad = n.mark(s)
    gpu.open(gate)
    with pytest.raises(hotloop.StepError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        n.wait(bad, timeout=10)
    assert n.done(ok)
    # Once the context is faulted, a mark is refused with the driver's message or fails like the step did.
    try:
        later = n.mark(s)
    except hotloop.CudaError as e:
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(e)
    else:
        with pytest.raises(hotloop.StepError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            n.wait(later, timeout=10)


def test_no_current_context_is_a_clear_error(gpu):
    errors = []

    def create():
        try:
            hotloop.cuda.StepNotifier()
        except hotloop.CudaError as e:
            errors.append(str(e))

    t = threading.Thread(target=create)
    t.start()
    t.join()
    if gpu.name == "real":
        pytest.skip("torch may make the context current on new threads")
    assert errors and "no current CUDA context" in errors[0]


def _in_fresh_process(code: str, **env) -> str:
    run_env = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_a_driver_cuda_is_unavailable_and_says_why():
    out = _in_fresh_process(
        "import hotloop.cuda as c\n"
        "print(c.is_available())\n"
        "print(c.unavailable_reason())\n"
        "try:\n"
        "    c.StepNotifier()\n"
        "except c.CudaUnavailableError as e:\n"
        "    print('raised', isinstance(e, c.CudaError), e)\n",
        HOTLOOP_CUDA_DRIVER="/nonexistent/libcuda.so.1",
    )
    lines = out.splitlines()
    assert lines[0] == "False"
    assert "could not be loaded" in lines[1] and "HostStepNotifier" in lines[1]
    assert lines[2].startswith("raised True the CUDA driver could not be loaded")


def test_driver_init_failure_and_missing_entry_points_are_reported():
    from hotloop.testing import FAKE_CUDA_LIBRARY

    code = "import hotloop.cuda as c; print(c.unavailable_reason())"
    no_device = _in_fresh_process(code, HOTLOOP_CUDA_DRIVER=FAKE_CUDA_LIBRARY, HOTLOOP_FAKE_CUDA_INIT="100")
    assert "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)" in no_device
    missing = _in_fresh_process(code, HOTLOOP_CUDA_DRIVER=FAKE_CUDA_LIBRARY, HOTLOOP_FAKE_CUDA_HIDE="cuEventRecord")
    assert "lacks driver entry points hotloop needs (cuEventRecord)" in missing
    fine = _in_fresh_process("import hotloop.cuda as c; print(c.is_available(), c.driver_info()['version'])",
                             HOTLOOP_CUDA_DRIVER=FAKE_CUDA_LIBRARY)
    assert fine == "True 13000"
