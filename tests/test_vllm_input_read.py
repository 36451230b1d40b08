"""The engine core's input sockets read by its main thread (hotloop.vllm.input_read), against a stand-in of vLLM's
engine-core module (its make_zmq_socket, decoders, request types and EngineCoreProc) and real ZeroMQ sockets: every
request a front end sends is read once, in order, by the thread waiting for it, however the sends and the waits
interleave; errors are answered as vLLM answers them; and where the main thread cannot read, vLLM's input thread
runs."""

from __future__ import annotations

import enum
import logging
import pickle
import queue
import random
import sys
import threading
import time
import types
import uuid
from collections import deque
from concurrent.futures import Future

import pytest
import zmq

from hotloop.vllm import engine_loop, input_read, mirrored
from hotloop.vllm.engine_loop import EngineInputQueue, StepWait
from hotloop.vllm.queue_slot import QueueSlot

FT_METHOD = "ft_command"


class RequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


class CacheMiss(Exception):
    pass


class Request:
    def __init__(self, request_id, prompt):
        self.request_id, self.prompt = request_id, prompt


class Decoder:
    """MsgpackDecoder's call, unpickling the frames' concatenation."""

    def __init__(self, t=None, oob_tensor_provider=None):
        self.t = t

    def decode(self, frames):
        return pickle.loads(b"".join(bytes(f.buffer) for f in frames))


def make_socket(ctx, path, socket_type, identity=None, bind=None, linger=None):
    sock = ctx.socket(socket_type)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.bind(path) if bind else sock.connect(path)
    return sock


class Responses:
    """What the reader's checks see of a response queue on hotloop's ring: its wait source."""

    def __init__(self):
        self.hotloop_source = engine_loop.InputQueue()


class Core:
    input_queue = QueueSlot("input_queue", EngineInputQueue)
    process_input_sockets = input_read.process_input_sockets

    def __init__(self):
        self.input_queue = queue.Queue()  # vLLM's constructor's, before the plugin loads
        self.aborts_queue = queue.Queue()
        self.tensor_ipc_receiver = None
        self.model_executor = types.SimpleNamespace(response_mqs=[Responses()])
        self.answered = []  # (handler, request id)
        self.handled = []

    def _make_ready_response(self):
        return {"status": "READY"}

    def preprocess_add_request(self, req):
        if req.prompt == "refuse":
            raise ValueError("bad request")
        if req.prompt == "miss":
            raise CacheMiss()
        return ("preprocessed", req.request_id)

    def _handle_mm_cache_miss(self, req, e):
        self.answered.append(("cache miss", req.request_id))

    def _handle_request_preproc_error(self, req):
        self.answered.append(("preproc error", req.request_id))

    def _handle_client_request(self, request_type, request):
        self.handled.append((request_type, request))


def vllms_input_thread(self, input_addresses, coord_input_address, identity, ready_event):
    """Stands for vLLM's own process_input_sockets: notes that it ran."""
    self.vllms_thread_ran = True
    ready_event.set()


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.SimpleNamespace(
        make_zmq_socket=make_socket, MsgpackDecoder=Decoder, EngineCoreRequest=Request,
        EngineCoreRequestType=RequestType, MultiModalCacheMissError=CacheMiss, FT_UTILITY_METHOD=FT_METHOD,
        EngineCoreProc=Core)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", mod)
    monkeypatch.setattr(input_read, "_vllm_process_input_sockets", vllms_input_thread)
    monkeypatch.setitem(input_read.MIRRORED, mirrored.body_digest(vllms_input_thread), "the stand-in")
    return mod


class FrontEnd:
    """The front end's ROUTER, as vLLM's client binds it; `start(core)` runs the engine core's input thread and
    waits for its ready payload."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.addr = f"ipc:///tmp/hotloop-input-read-{uuid.uuid4().hex}"
        self.router.bind(self.addr)
        self.identity = b"\x00\x00"
        self.lock = threading.Lock()

    def start(self, core, coord_addr=None):
        ready = threading.Event()
        thread = threading.Thread(target=core.process_input_sockets, args=([self.addr], coord_addr, self.identity,
                                                                           ready), daemon=True)
        thread.start()
        assert ready.wait(10)
        if not getattr(core, "vllms_thread_ran", False):
            identity, payload = self.router.recv_multipart()
            assert identity == self.identity and payload  # the ready payload, before any request
        return thread

    def send(self, request_type: RequestType, obj):
        with self.lock:
            self.router.send_multipart([self.identity, request_type.value, pickle.dumps(obj)])

    def add(self, rid, prompt="p"):
        self.send(RequestType.ADD, Request(rid, prompt))

    def close(self):
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def front_end():
    fe = FrontEnd()
    yield fe
    fe.close()


def stop(core, thread):
    core.input_queue.reader.close()
    thread.join(10)
    assert not thread.is_alive()
    assert core.input_queue.reader is None  # detached before the sockets closed


def test_requests_sent_while_the_main_thread_waits_are_each_read_once_in_order(fake_vllm, front_end):
    core = Core()
    thread = front_end.start(core)
    reader = core.input_queue.reader
    assert isinstance(reader, input_read.InputReader)
    n = 3000
    rng = random.Random(7)

    def send():
        for i in range(n):
            front_end.add(f"r{i}")
            if rng.random() < 0.02:  # now and then a gap long enough for the reader to park
                time.sleep(rng.random() * 0.002)

    sender = threading.Thread(target=send)
    sender.start()
    got = []
    for _ in range(n):
        got.append(core.input_queue.get(timeout=10))  # a lost wake-up fails here, not hangs
    sender.join()
    assert got == [(RequestType.ADD, ("preprocessed", f"r{i}")) for i in range(n)]
    assert reader.messages == n
    assert core.input_queue.empty() and core.input_queue.qsize() == 0
    with pytest.raises(queue.Empty):
        core.input_queue.get(timeout=0.05)
    stop(core, thread)


def arrived(core, timeout=10.0):
    """Wait (outside the queue under test) until the front end's socket holds a message: poll does not take it."""
    assert core.input_queue.reader.sockets[0].poll(int(timeout * 1000)), "the front end's message never arrived"


def test_get_nowait_empty_and_qsize_each_read_the_socket(fake_vllm, front_end):
    core = Core()
    thread = front_end.start(core)
    q = core.input_queue
    front_end.add("a")
    arrived(core)
    assert not q.empty()  # read by empty() itself
    assert q.get_nowait() == (RequestType.ADD, ("preprocessed", "a"))
    front_end.send(RequestType.ABORT, ["x"])
    arrived(core)
    assert q.get_nowait() == (RequestType.ABORT, ["x"])  # read by get_nowait() itself
    assert core.aborts_queue.get_nowait() == ["x"]  # as vLLM: an abort goes into both queues
    front_end.send(RequestType.UTILITY, (0, 1, "is_sleeping", ()))
    arrived(core)
    assert q.qsize() == 1  # read by qsize() itself
    assert q.get_nowait() == (RequestType.UTILITY, (0, 1, "is_sleeping", ()))
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert q.empty()
    stop(core, thread)


def test_other_threads_puts_keep_their_place_and_wake_a_blocking_get(fake_vllm, front_end):
    core = Core()
    thread = front_end.start(core)
    q = core.input_queue
    q.put_nowait(("EXECUTOR_FAILED", b""))  # the executor's monitor thread puts into the queue
    front_end.add("a")
    arrived(core)
    assert [q.get_nowait(), q.get_nowait()] == [("EXECUTOR_FAILED", b""), (RequestType.ADD, ("preprocessed", "a"))]
    # a get() parked on the sockets and the queue is woken by a put from another thread (vLLM's WAKEUP on shutdown)
    waker = threading.Timer(0.1, q.put_nowait, args=(("WAKEUP", None),))
    waker.start()
    assert q.get(timeout=10) == ("WAKEUP", None)
    waker.join()
    stop(core, thread)


def test_a_burst_is_read_in_batches_and_the_step_wait_looks_at_the_answer_between_two(fake_vllm, front_end,
                                                                                       response_queue):
    writer, reader = response_queue
    core = Core()
    core.model_executor.response_mqs = [reader]
    thread = front_end.start(core)
    n = 5 * input_read.READ_BATCH
    for i in range(n):
        front_end.add(f"r{i}")
    arrived(core)
    time.sleep(0.2)  # ZeroMQ moves the rest of the burst into the socket's pipe meanwhile (a poll cannot count it)
    handled_before_answer = []

    def on_first(request_type, request):  # the step's answer comes while the first batch is handled
        if not handled_before_answer:
            writer.enqueue((0, "output"))
        handled_before_answer.append(request)

    core._handle_client_request = lambda t, r: (on_first(t, r), core.handled.append((t, r)))
    step = Step([reader], deadline=time.monotonic() + 30)
    StepWait(core).wait_for(step)
    assert step.result() == "output"
    # the answer was read after the batch it came during, not after the whole burst
    assert len(core.handled) == input_read.READ_BATCH
    rest = []
    while not core.input_queue.empty():
        rest.append(core.input_queue.get_nowait())
    assert [r for _, r in core.handled] + [r for _, r in rest] == [("preprocessed", f"r{i}") for i in range(n)]
    stop(core, thread)


def test_a_read_waits_for_another_threads_batch_and_loses_nothing(fake_vllm, front_end):
    core = Core()
    thread = front_end.start(core)
    q, reader = core.input_queue, core.input_queue.reader
    front_end.add("a")
    arrived(core)
    got = []
    with reader.lock:  # another thread's read in progress
        t = threading.Thread(target=lambda: got.append(q.read()))
        t.start()
        t.join(0.2)
        assert t.is_alive()  # waits for the lock: a read that returned 0 here could let a wait miss "a"
    t.join(10)
    assert got == [1] and q.get_nowait() == (RequestType.ADD, ("preprocessed", "a"))
    stop(core, thread)


def test_a_request_preprocessing_refuses_is_answered_by_vllms_handlers_and_the_rest_go_on(fake_vllm, front_end):
    core = Core()
    thread = front_end.start(core)
    front_end.add("bad", "refuse")
    front_end.add("missed", "miss")
    front_end.add("good")
    assert core.input_queue.get(timeout=10) == (RequestType.ADD, ("preprocessed", "good"))
    assert core.answered == [("preproc error", "bad"), ("cache miss", "missed")]
    assert core.input_queue.reader.messages == 3
    stop(core, thread)


def test_a_corrupt_message_raises_in_the_reading_thread(fake_vllm, front_end):
    core = Core()
    thread = front_end.start(core)
    with front_end.lock:
        front_end.router.send_multipart([front_end.identity, b"\x09", b"?"])  # no such request type
    with pytest.raises(ValueError):
        core.input_queue.get(timeout=10)
    front_end.add("after")  # the socket is still whole
    assert core.input_queue.get(timeout=10) == (RequestType.ADD, ("preprocessed", "after"))
    stop(core, thread)


class Step(Future):
    """vLLM 0.32's FutureWrapper for one step (v1/executor/multiproc_executor.py), its get_response closure as
    collective_rpc writes it."""

    def __init__(self, response_mqs, deadline=None):
        super().__init__()
        self.futures_queue = deque([self])

        def get_response():
            return [mq.dequeue(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))[1]
                    for mq in response_mqs]

        self.get_response = get_response

    def _wait_for_response(self):  # the waiter has taken it off futures_queue
        self.set_result(self.get_response()[0])


def test_the_step_wait_handles_a_request_that_reaches_the_socket_during_the_step(fake_vllm, front_end, response_queue):
    writer, reader = response_queue
    core = Core()
    core.model_executor.response_mqs = [reader]
    thread = front_end.start(core)
    step = Step([reader], deadline=time.monotonic() + 30)
    missed = []

    def step_runs():  # the step answers only once the request is handled: a wait blind to the socket never ends
        time.sleep(0.05)
        front_end.add("mid-step")
        deadline = time.monotonic() + 10
        while not core.handled and time.monotonic() < deadline:
            time.sleep(0.001)
        if not core.handled:
            missed.append("mid-step")
        writer.enqueue((0, "output"))

    helper = threading.Thread(target=step_runs)
    helper.start()
    StepWait(core).wait_for(step)
    helper.join()
    assert not missed
    assert step.result() == "output"
    assert core.handled == [(RequestType.ADD, ("preprocessed", "mid-step"))]
    assert core.input_queue.reader.messages == 1
    stop(core, thread)


def test_the_coordinators_ready_notices_are_skipped(fake_vllm, front_end):
    xpub = front_end.ctx.socket(zmq.XPUB)
    coord = f"ipc:///tmp/hotloop-input-read-coord-{uuid.uuid4().hex}"
    xpub.bind(coord)
    core = Core()

    def coordinator():
        assert xpub.recv() == b"\x01"  # the engine's subscription
        xpub.send(b"READY")

    helper = threading.Thread(target=coordinator)
    helper.start()
    thread = front_end.start(core, coord)
    helper.join()
    xpub.send(b"READY")  # a newly started engine's notice: skipped
    xpub.send_multipart([RequestType.UTILITY.value, pickle.dumps((-1, 0, "wave", ()))])
    assert core.input_queue.get(timeout=10) == (RequestType.UTILITY, (-1, 0, "wave", ()))
    assert core.input_queue.reader.messages == 2
    xpub.close(0)
    stop(core, thread)


@pytest.mark.parametrize("why", ["loop off", "tensor ipc", "fault tolerance", "other executor", "unknown body"])
def test_where_the_main_thread_cannot_read_vllms_input_thread_runs(fake_vllm, front_end, monkeypatch, caplog, why):
    core = Core()
    if why == "loop off":
        core.__dict__["input_queue"] = queue.SimpleQueue()
    elif why == "tensor ipc":
        core.tensor_ipc_receiver = object()
    elif why == "fault tolerance":
        core.ft_sentinel = object()
    elif why == "other executor":
        core.model_executor = types.SimpleNamespace()
    else:
        monkeypatch.setattr(input_read, "MIRRORED", {})
    with caplog.at_level(logging.INFO, logger="vllm.hotloop"):
        front_end.start(core)
    assert core.vllms_thread_ran
    assert getattr(core.input_queue, "reader", None) is None
    assert "vLLM's input thread" in caplog.text
    if why == "unknown body":
        assert any(r.levelno == logging.WARNING and "not one this module mirrors" in r.getMessage()
                   for r in caplog.records)


def test_the_installed_vllms_body_is_one_the_reader_mirrors():
    core = pytest.importorskip("vllm.v1.engine.core")
    original = core.EngineCoreProc.__dict__["process_input_sockets"]
    if original is input_read.process_input_sockets:
        original = input_read._vllm_process_input_sockets
    assert mirrored.body_digest(original) in input_read.MIRRORED
