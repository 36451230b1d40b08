"""The liveness link (hotloop.engine.executors.liveness), on loopback: a stranger that connects to a rank's
liveness port without the token is dropped within HANDSHAKE_TIMEOUT_S and does not keep the engine out; the
engine's link is then held; a link the engine closes is reported to the rank as closed (why None)."""

import socket
import threading
import time

from conftest import wait_until

from hotloop.engine.executors import liveness

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
