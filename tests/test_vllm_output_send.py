"""The engine core's outputs sent by their putting thread (hotloop.vllm.output_send), against a stand-in of vLLM's
engine-core module (its make_zmq_socket, MsgpackEncoder and EngineCoreProc) and real ZeroMQ sockets: every output
arrives once, in put order, whichever thread sends it, also when the front end is not there yet, when the encoder
refuses one, and after the output thread has ended."""

from __future__ import annotations

import logging
import pickle
import queue
import sys
import threading
import types
import uuid

import pytest
import zmq

from hotloop.vllm import mirrored, output_send
from hotloop.vllm.output_send import OutputQueue
from hotloop.vllm.queue_slot import QueueSlot

DEAD = b"ENGINE_CORE_DEAD"


class Outputs:
    def __init__(self, value):
        self.value = value
        self.engine_index = None


class Encoder:
    """MsgpackEncoder's two calls, pickling; refuses an Outputs whose value is "refuse"."""

    def encode_into(self, outputs, buf):
        if outputs.value == "refuse":
            raise TypeError("cannot encode")
        buf[:] = pickle.dumps((outputs.engine_index, outputs.value))
        return [buf, b"tail"]

    def encode(self, outputs):
        return [pickle.dumps(("coord", outputs.value))]


def make_socket(ctx, path, socket_type, bind=None, linger=None):
    sock = ctx.socket(socket_type)
    sock.linger = linger
    sock.connect(path) if not bind else sock.bind(path)
    return sock


class Core:
    output_queue = QueueSlot("output_queue", OutputQueue)
    process_output_sockets = output_send.process_output_sockets
    ENGINE_CORE_DEAD = DEAD

    def __init__(self):
        self.output_queue = queue.Queue()  # vLLM's constructor's, before the plugin loads


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.SimpleNamespace(make_zmq_socket=make_socket, MsgpackEncoder=Encoder, EngineCoreProc=Core)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", mod)
    return mod


@pytest.fixture
def front_end():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc:///tmp/hotloop-output-send-{uuid.uuid4().hex}"
    pull.bind(addr)
    yield addr, pull
    pull.close(0)
    ctx.term()


@pytest.fixture
def bound_push(fake_vllm):
    """The output thread's PUSH socket binds (vLLM's connect): it has no peer, so takes nothing, until the test
    connects a PULL."""
    def bound(ctx, path, socket_type, bind=None, linger=None):
        return make_socket(ctx, path, socket_type, bind=True, linger=linger)

    fake_vllm.make_zmq_socket = bound
    return f"ipc:///tmp/hotloop-output-send-{uuid.uuid4().hex}"


def receive(pull, n, timeout_ms=5000):
    got = []
    while len(got) < n:
        assert pull.poll(timeout_ms), f"only {len(got)} of {n} outputs arrived"
        frames = pull.recv_multipart()
        if frames == [DEAD]:
            got.append(DEAD)
            continue
        assert frames[1] == b"tail"  # the message's frames arrive together
        got.append(pickle.loads(frames[0]))
    return got


def start(core, addr):
    thread = threading.Thread(target=core.process_output_sockets, args=([addr], None, 7), daemon=True)
    thread.start()
    return thread


def attached(q):
    with q.lock:
        return q.sender is not None


def wait_attached(q):
    for _ in range(5000):
        if attached(q):
            return
        threading.Event().wait(0.001)
    raise AssertionError("the output thread never opened its sockets")


def test_puts_behind_a_backlog_queue_and_every_output_arrives_once_in_put_order(fake_vllm, bound_push):
    # a backlog first (a socket with no front end yet takes nothing), then two threads put while the output thread
    # drains it: a put that went out directly past the backlog would reorder the main thread's outputs
    addr = bound_push
    core = Core()
    core.__dict__["output_queue"].put_nowait((0, Outputs(("main", 0))))  # put before the conversion
    thread = start(core, addr)
    q = core.output_queue
    n, backlog = 3000, 200
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        wait_attached(q)
        for i in range(1, backlog):
            q.put_nowait((0, Outputs(("main", i))))
        assert q.direct == 0 and q.queued == backlog

        def put_many(tag, first):
            for i in range(first, first + n):
                core.output_queue.put_nowait((0, Outputs((tag, i))))

        other = threading.Thread(target=put_many, args=("other", 0))
        pull.connect(addr)
        other.start()
        put_many("main", backlog)
        other.join()
        got = receive(pull, 2 * n + backlog)
        assert got[0] == (7, ("main", 0))  # engine_index set, the early one first
        assert [v for _, (t, v) in got if t == "main"] == list(range(backlog + n))  # none lost, duplicated, reordered
        assert [v for _, (t, v) in got if t == "other"] == list(range(n))
        assert q.direct + q.queued == 2 * n + backlog and q.queued > backlog
        for _ in range(5000):  # the output thread counts each send after it: once all are counted, the next put
            with q.lock:       # goes out directly again
                if q.unsent == 0:
                    break
            threading.Event().wait(0.001)
        direct = q.direct
        q.put_nowait((0, Outputs(("main", -1))))
        assert q.direct == direct + 1 and receive(pull, 1) == [(7, ("main", -1))]
        assert not pull.poll(50)
    finally:
        q.put_nowait(DEAD)
        thread.join(5)
        pull.close(0)
        ctx.term()
    assert not thread.is_alive()


def test_an_output_with_nothing_ahead_of_it_is_sent_by_the_putting_thread(fake_vllm, front_end):
    # a step's outputs, one at a time: each goes out without the hand-off to the output thread
    addr, pull = front_end
    core = Core()
    thread = start(core, addr)
    q = core.output_queue
    try:
        wait_attached(q)
        for i in range(200):
            q.put_nowait((0, Outputs(i)))
            assert receive(pull, 1) == [(7, i)]
        assert (q.direct, q.queued) == (200, 0)
    finally:
        q.put_nowait(DEAD)
        thread.join(5)


def test_outputs_wait_for_a_socket_that_would_block(fake_vllm, bound_push):
    # a PUSH socket with no peer would block: each put queues for the output thread, and all arrive in order once
    # a front end is there (vLLM's sockets connect, so never block; this is the fallback)
    addr = bound_push
    core = Core()
    thread = start(core, addr)
    q = core.output_queue
    wait_attached(q)
    for i in range(50):
        q.put_nowait((0, Outputs(i)))
    assert q.direct == 0 and q.queued == 50
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(addr)
    try:
        assert [v for _, v in receive(pull, 50)] == list(range(50))
        q.put_nowait(DEAD)
        assert receive(pull, 1) == [DEAD]
        thread.join(5)
    finally:
        pull.close(0)
        ctx.term()


def test_an_output_the_encoder_refuses_fails_on_the_output_thread_as_in_vllm(fake_vllm, front_end):
    addr, pull = front_end
    core = Core()
    errors = []
    threading.excepthook, old = (lambda args: errors.append(args.exc_value)), threading.excepthook
    try:
        thread = start(core, addr)
        q = core.output_queue
        wait_attached(q)
        q.put_nowait((0, Outputs("before")))
        q.put_nowait((0, Outputs("refuse")))  # the putting thread does not raise: vLLM's put never does
        thread.join(5)
        assert not thread.is_alive() and isinstance(errors[0], TypeError)
    finally:
        threading.excepthook = old
    assert receive(pull, 1) == [(7, "before")]
    assert not attached(q)
    q.put_nowait((0, Outputs("after")))  # the thread is gone: queued, as vLLM's queue keeps it
    assert q.queued == 2 and not pull.poll(50)


def test_puts_after_the_output_thread_ended_are_queued_not_sent_on_closed_sockets(fake_vllm, front_end):
    addr, pull = front_end
    core = Core()
    thread = start(core, addr)
    q = core.output_queue
    wait_attached(q)
    q.put_nowait((0, Outputs(1)))
    q.put_nowait(DEAD)
    assert receive(pull, 2) == [(7, 1), DEAD]
    thread.join(5)
    assert not attached(q)
    for i in range(3):
        q.put_nowait((0, Outputs(i)))
    assert q.qsize() == 3


def test_coordinator_outputs_go_to_the_coordinators_socket(fake_vllm, front_end):
    addr, pull = front_end
    ctx = zmq.Context()
    coord = ctx.socket(zmq.PULL)
    coord_addr = f"ipc:///tmp/hotloop-output-send-{uuid.uuid4().hex}"
    coord.bind(coord_addr)
    core = Core()
    thread = threading.Thread(target=core.process_output_sockets, args=([addr], coord_addr, 0), daemon=True)
    thread.start()
    try:
        wait_attached(core.output_queue)
        core.output_queue.put_nowait((-1, Outputs("stats")))
        core.output_queue.put_nowait((0, Outputs("tokens")))
        assert coord.poll(5000) and pickle.loads(coord.recv_multipart()[0]) == ("coord", "stats")
        assert receive(pull, 1) == [(0, "tokens")]
        core.output_queue.put_nowait(DEAD)
        thread.join(5)
    finally:
        coord.close(0)
        ctx.term()


def test_the_send_is_on_unless_the_switch_turns_it_off(monkeypatch):
    for value, want in ((None, True), ("1", True), ("on", True), ("0", False), ("off", False)):
        if value is None:
            monkeypatch.delenv("HOTLOOP_VLLM_SEND", raising=False)
        else:
            monkeypatch.setenv("HOTLOOP_VLLM_SEND", value)
        assert output_send.send_enabled() is want, value


def test_install_takes_over_only_an_output_thread_it_mirrors(fake_vllm, monkeypatch, caplog):
    class Proc:
        def process_output_sockets(self, output_paths, coord_output_path, engine_index):
            return "vLLM's own"

    fake_vllm.EngineCoreProc = Proc
    with caplog.at_level(logging.WARNING, logger="vllm.hotloop"):
        assert output_send.install() is False  # a body output_send was not written against: left to vLLM
    assert Proc.__dict__["process_output_sockets"] is not output_send.process_output_sockets
    assert "not one output_send mirrors" in caplog.text
    monkeypatch.setitem(output_send.MIRRORED, mirrored.body_digest(Proc.process_output_sockets), "the stand-in")
    try:
        assert output_send.install() is True
        assert Proc.__dict__["process_output_sockets"] is output_send.process_output_sockets
    finally:
        output_send.uninstall()
    assert Proc().process_output_sockets([], None, 0) == "vLLM's own"


def test_the_installed_vllms_output_thread_is_one_output_send_mirrors():
    core = pytest.importorskip("vllm.v1.engine.core")
    original = core.EngineCoreProc.__dict__["process_output_sockets"]
    if original is output_send.process_output_sockets:
        pytest.skip("installed in this process; the wheel checks in test_vllm_source cover the body")
    assert mirrored.body_digest(original) in output_send.MIRRORED


def test_the_large_output_bench_delivers_every_output_through_both_output_threads():
    # python -m hotloop.bench.vllm.output_encode: vLLM's own output thread and hotloop's send, each with vLLM's real
    # encoder and a front-end process decoding every message (run_arm raises on one missing); a step's outputs
    # with logprobs, device-bound: hotloop's main thread sends each itself, nothing queued behind another
    pytest.importorskip("vllm.v1.engine.core")
    from hotloop.bench.vllm import output_encode

    outs = output_encode._outputs(8, 5, 0)
    work = output_encode._schedule_work(50)
    got = {arm: output_encode.run_arm(outs, arm, 20, work, 3000.0) for arm in output_encode.ARMS}
    assert (got["hotloop"]["direct"], got["hotloop"]["queued"]) == (20, 0), got["hotloop"]
    for arm, res in got.items():
        assert 0 < res["latency_p50_us"] < 1e6 and res["steps_per_s"] <= 1 / 3000e-6 * 1.05, (arm, res)
