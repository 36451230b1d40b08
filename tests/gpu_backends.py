"""What the notifier tests need from a GPU, on the fake driver (always) or a real one (HOTLOOP_TEST_CUDA=real).

A "gated" kernel runs until its gate is opened: exactly so on the fake driver; on a real GPU it is a kernel of
fixed length (long enough for a test's checks before it ends) and opening the gate does nothing.
"""

import time


class FakeGpu:
    name = "fake"
    can_fault = True

    def __init__(self):
        from hotloop.testing import FakeCudaDriver

        self.fake = FakeCudaDriver()
        self.fake.make_current()
        self._streams = []
        self._gates = []

    def stream(self) -> int:
        s = self.fake.stream_create()
        self._streams.append(s)
        return s

    def sleep(self, stream: int, seconds: float) -> None:
        self.fake.launch_sleep(stream, seconds)

    def gated(self, stream: int):
        gate = self.fake.launch_gated(stream)
        self._gates.append(gate)
        return gate

    def open(self, gate) -> None:
        self.fake.open_gate(gate)

    def fault(self, stream: int) -> None:
        self.fake.launch_fault(stream)

    def close(self) -> None:
        for gate in self._gates:  # a failed test may have left one closed
            self.fake.open_gate(gate)
        for s in self._streams:
            self.fake.stream_destroy(s)
        self.fake.reset_error()


class RealGpu:
    name = "real"
    can_fault = False  # a real fault poisons the context for the rest of the process
    GATE_SECONDS = 0.3

    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # makes the primary context current on this thread
        self._streams = {}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)  # calibrate: cycles per second of the sleep kernel
        end.record()
        end.synchronize()
        self._cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)

    def stream(self) -> int:
        s = self.torch.cuda.Stream()
        self._streams[s.cuda_stream] = s
        return s.cuda_stream

    def sleep(self, stream: int, seconds: float) -> None:
        with self.torch.cuda.stream(self._streams[stream]):
            self.torch.cuda._sleep(int(seconds * self._cycles_per_s))

    def gated(self, stream: int):
        self.sleep(stream, self.GATE_SECONDS)
        return time.monotonic() + self.GATE_SECONDS

    def open(self, gate) -> None:
        pass

    def fault(self, stream: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.torch.cuda.synchronize()
