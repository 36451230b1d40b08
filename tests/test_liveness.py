"""The liveness link (hotloop.engine.executors.liveness), on loopback: a stranger that connects to a rank's
liveness port without the token is dropped within HANDSHAKE_TIMEOUT_S and does not keep the engine out; the
engine's link is then held; a link the engine closes is reported to the rank as closed (why None); vLLM's Ray
executor's verdict on a lost rank, and that verdict winning over the rank's answers' own lost connection."""

import os
import signal
import socket
import threading
import time

from conftest import require_torch, wait_until

require_torch()  # the liveness link lives in hotloop.engine, which needs torch

from hotloop.engine.executors import liveness  # noqa: E402

TOKEN = b"t" * 16


def _rank_end(listener):
    lost = []
    thread = threading.Thread(target=liveness.hold, args=(listener, TOKEN, 30.0, lost.append), daemon=True)
    thread.start()
    return thread, lost


def test_a_stranger_is_dropped_within_the_handshake_bound_and_the_engine_gets_its_link():
    assert liveness.HANDSHAKE_TIMEOUT_S <= 1.0
    listener = liveness.listen("127.0.0.1")
    port = listener.getsockname()[1]
    thread, lost = _rank_end(listener)
    stranger = socket.create_connection(("127.0.0.1", port))  # says nothing
    t0 = time.monotonic()
    stranger.settimeout(5)
    assert stranger.recv(1) == b""  # closed by the rank's end
    dropped_after = time.monotonic() - t0
    assert dropped_after <= liveness.HANDSHAKE_TIMEOUT_S + 0.5, dropped_after
    stranger.close()

    lost_by_engine = []
    watcher = liveness.LinkWatcher(lambda rank, why: lost_by_engine.append((rank, why)))
    watcher.connect(0, "127.0.0.1", port, TOKEN, 5)
    watcher.start()
    assert thread.is_alive() and lost == []  # held
    watcher.close()  # the engine's shutdown: the rank sees its link closed, not lost
    thread.join(5)
    assert not thread.is_alive() and lost == [None]
    assert lost_by_engine == []


def test_a_wrong_token_is_refused_and_the_right_one_still_gets_in():
    listener = liveness.listen("127.0.0.1")
    port = listener.getsockname()[1]
    thread, lost = _rank_end(listener)
    wrong = socket.create_connection(("127.0.0.1", port))
    wrong.sendall(b"x" * len(TOKEN))
    wrong.settimeout(5)
    assert wrong.recv(1) == b""
    wrong.close()
    watcher = liveness.LinkWatcher(lambda rank, why: None)
    watcher.connect(3, "127.0.0.1", port, TOKEN, 5)
    watcher.start()
    wait_until(lambda: listener.fileno() == -1, 5)  # the rank's end closed its listener once it had the engine
    assert thread.is_alive() and lost == []
    watcher.close()
    thread.join(5)
    assert lost == [None]


def test_vllm_ray_executor_lost_rank_fails_the_engine_wait_once_and_kills_the_actors():
    """hotloop.vllm.ray_liveness's verdict on a lost rank, on a stand-in executor: the engine core's wait for the
    step's answer ends with DeadPeerError naming the rank and node, every actor is killed, vLLM's failure callback
    runs once; nothing happens once the executor is shutting down."""
    import types

    import pytest

    pytest.importorskip("ray")
    from hotloop._core import DeadPeerError
    from hotloop.vllm import ray_liveness
    from hotloop.vllm.message_queue import MessageQueue

    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    calls, killed = [], []
    actors = [types.SimpleNamespace(rank=r, actor=f"actor{r}") for r in range(2)]
    executor = types.SimpleNamespace(shutting_down=False, is_failed=False, response_mqs=[reader],
                                     ray_worker_handles=actors, failure_callback=lambda: calls.append("failed"))
    links = ray_liveness._Links()
    links.where[1] = "Ray node abc at 10.0.0.2"
    links.executor = executor
    import ray

    real_kill, ray.kill = ray.kill, killed.append
    try:
        links._lost(1, "its node did not answer for 3 s")
        links._lost(1, "again")  # the first verdict stands: not failed twice
    finally:
        ray.kill = real_kill
    assert executor.is_failed and calls == ["failed"]
    assert killed == ["actor0", "actor1"]
    with pytest.raises(DeadPeerError, match=r"rank 1 \(Ray node abc at 10.0.0.2\): its node did not answer"):
        reader.dequeue(timeout=5)

    late = ray_liveness._Links()
    late.executor = types.SimpleNamespace(shutting_down=True, is_failed=False, failure_callback=None)
    late._lost(0, "late")  # a link that ends during vLLM's own shutdown is not a failure
    assert not late.executor.is_failed
    writer.close()


def _answers_then_die(conn):
    """A rank's answers' writer on TCP (hotloop.vllm's queue) whose process dies: its reader's connection is lost."""
    from hotloop.vllm.message_queue import MessageQueue

    writer = MessageQueue(1, 0, connect_ip="127.0.0.1")
    conn.send(writer.export_handle())
    writer.wait_until_ready(10)
    writer.enqueue("last answer")
    conn.recv()  # the reader has it
    os.kill(os.getpid(), signal.SIGKILL)


def test_vllm_ray_executor_answers_lost_before_the_link_still_fail_with_the_links_verdict():
    """A rank cut off: its answers' connection and its liveness link give it up after the same timeout, in either
    order. When the answers' connection goes first, the engine core's read waits for the link's verdict (REPORT_GRACE_S)
    and raises it, naming the rank and node, not the queue's own "lost the connection"."""
    import multiprocessing
    import types

    import pytest

    pytest.importorskip("ray")
    import ray

    from hotloop._core import DeadPeerError
    from hotloop.engine.executors.worker_group import REPORT_GRACE_S
    from hotloop.vllm import ray_liveness
    from hotloop.vllm.message_queue import MessageQueue

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_answers_then_die, args=(child,))
    proc.start()
    reader = MessageQueue.create_from_handle(parent.recv(), 0)
    executor = types.SimpleNamespace(shutting_down=False, is_failed=False, response_mqs=[reader],
                                     ray_worker_handles=[], failure_callback=None)
    links = ray_liveness._Links()
    links.where[0] = "Ray node abc at 10.0.0.2"
    links.start(executor)  # no link of its own here: the test gives the verdict
    assert reader.report_grace_s == REPORT_GRACE_S
    verdict = threading.Timer(0.2, links._lost, [0, "its node did not answer for 3 s"])
    real_kill, ray.kill = ray.kill, lambda actor: None
    try:
        assert reader.dequeue(timeout=10) == "last answer"
        parent.send("die")
        proc.join(10)
        verdict.start()
        t0 = time.monotonic()
        with pytest.raises(DeadPeerError, match=r"^rank 0 \(Ray node abc at 10.0.0.2\): its node did not answer"):
            reader.dequeue(timeout=10)
        assert time.monotonic() - t0 < REPORT_GRACE_S
    finally:
        verdict.cancel()
        if verdict.ident is not None:
            verdict.join()
        ray.kill = real_kill
        links.close()
        reader.close()
        proc.join(10)
        proc.close()
        parent.close()
        child.close()
