"""A node's relay (hotloop/queue/relay.py): remote readers that name the same node share one stream from the writer.

Readers run in processes of their own, two "nodes" on this machine (named by create_from_handle's node=): every
message reaches every reader once, in order; the writer counts and loses ranks one by one; a dead relay is a
dead peer for every rank behind it (the writer names a rank and the node, the node's readers raise
DeadPeerError once drained); nothing is left in /dev/shm."""

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from hotloop import ClosedError, DeadPeerError, MessageQueue, _core
from hotloop.queue.relay import ring_name

READER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay_reader.py")
BOUND_S = 5.0  # a dead process is seen at once (its connections close); slack for a loaded 2-core machine


class Reader:
    def __init__(self, handle_path, rank, node):
        self.rank, self.node = rank, node
        self.proc = subprocess.Popen([sys.executable, READER, handle_path, str(rank), node], stdout=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, key, timeout=60.0):
        deadline = time.monotonic() + timeout
        while True:
            msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert msg is not None, f"rank {self.rank} ended (exit {self.proc.wait()}) before printing {key!r}"
            if key in msg:
                return msg

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def cluster(tmp_path):
    """start(placement, **queue_kwargs) -> (writer, {rank: Reader}): rank 0 local (in this process: None), the
    others remote on the nodes `placement` names ({rank: node})."""
    made = []

    def start(placement, **kwargs):
        n_reader = 1 + len(placement)
        mq = MessageQueue(n_reader, 1, connect_ip="127.0.0.1", **kwargs)
        handle = mq.export_handle()
        path = str(tmp_path / f"handle-{len(made)}")
        with open(path, "wb") as f:
            pickle.dump(handle, f)
        readers = {rank: Reader(path, rank, node) for rank, node in placement.items()}
        local = MessageQueue.create_from_handle(handle, 0)
        made.append((mq, local, readers))
        rings.update(ring_name(handle.name, node) for node in placement.values())
        for r in readers.values():
            r.next("attached")
        mq.wait_until_ready(timeout=60)
        return mq, local, readers

    rings = set()  # this test's node rings (other test processes may run beside it and have their own)
    yield start
    for mq, local, readers in made:
        mq.close()
        local.close()
        for r in readers.values():
            r.close()
    # a relay killed before the first message leaves its ring's name for the reaper (every new queue runs it)
    _core.reap_stale_segments()
    left = {name for name in rings if os.path.exists("/dev/shm" + name)}
    assert not left, f"node rings left in /dev/shm: {left}"


def test_readers_on_a_node_share_one_stream_and_each_gets_every_message_once_in_order(cluster):
    mq, local, readers = cluster({1: "node-a", 2: "node-a", 3: "node-a", 4: "node-b", 5: "node-b"})
    stats = mq.network_stats
    assert stats["attached"] == [1, 2, 3, 4, 5]
    assert set(stats["relays"]) == {"node-a", "node-b"}, "one stream per node"
    assert stats["relays"]["node-a"] in (1, 2, 3) and stats["relays"]["node-b"] in (4, 5)
    n = 3000
    for i in range(n):  # every 200th message larger than a ring record: split into fragments and joined again
        mq.enqueue({"i": i, "pad": b"x" * (300_000 if i % 200 == 0 else 64)})
        assert local.dequeue(timeout=10)["i"] == i
    mq.shutdown()
    for rank, r in readers.items():
        end = r.next("end")
        assert end["got"] == list(range(n)), (rank, len(end["got"]))
        assert end["error"].startswith("ClosedError"), (rank, end)
        assert r.proc.wait(10) == 0


def _relay_and_other(mq, readers, node):
    relay = mq.network_stats["relays"][node]
    other = next(rank for rank, r in readers.items() if r.node == node and rank != relay)
    return relay, other


def _enqueue_until_error(mq, limit_s):
    t0, i = time.monotonic(), 0
    while time.monotonic() - t0 < limit_s:
        mq.enqueue({"i": i}, timeout=limit_s)
        i += 1
        time.sleep(0.002)
    return None


def test_a_killed_relay_is_a_dead_peer_for_every_rank_of_its_node(cluster):
    mq, local, readers = cluster({1: "node-a", 2: "node-a", 3: "node-b"})
    relay, other = _relay_and_other(mq, readers, "node-a")
    for i in range(100):
        mq.enqueue({"i": i})
    t_kill = time.monotonic()
    readers[relay].proc.send_signal(signal.SIGKILL)
    with pytest.raises(DeadPeerError) as e:
        _enqueue_until_error(mq, 30)
    assert time.monotonic() - t_kill < BOUND_S
    # the relay's stream or its rank's presence connection: whichever the writer sees close first
    assert "node 'node-a'" in str(e.value), e.value
    assert f"rank {relay}'s process" in str(e.value) or f"rank {relay} on node" in str(e.value), e.value
    end = readers[other].next("end")
    assert end["got"] == list(range(len(end["got"]))), "what the relay wrote before it died, in order, once"
    assert end["error"].startswith("DeadPeerError"), end
    assert end["t"] - t_kill < BOUND_S, f"the node's other reader saw it after {end['t'] - t_kill:.1f} s"


def test_with_dead_reader_drop_a_killed_relay_drops_its_node_and_the_others_go_on(cluster):
    mq, local, readers = cluster({1: "node-a", 2: "node-a", 3: "node-b", 4: "node-b"}, dead_reader="drop")
    relay, other = _relay_and_other(mq, readers, "node-a")
    readers[relay].proc.send_signal(signal.SIGKILL)
    readers[relay].proc.wait(10)
    n = 2000
    for i in range(n):
        mq.enqueue({"i": i})
        local.dequeue(timeout=10)
    deadline = time.monotonic() + BOUND_S
    while set(mq.network_stats["attached"]) != {3, 4} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(mq.network_stats["attached"]) == {3, 4}, "node-a's ranks were dropped"
    mq.shutdown()
    assert readers[other].next("end")["error"].startswith("DeadPeerError")
    for rank in (3, 4):
        end = readers[rank].next("end")
        assert end["got"] == list(range(n)) and end["error"].startswith("ClosedError"), (rank, end["error"])


def test_a_killed_reader_behind_a_relay_is_named_by_the_writer(cluster):
    mq, local, readers = cluster({1: "node-a", 2: "node-a"})
    relay, other = _relay_and_other(mq, readers, "node-a")
    t_kill = time.monotonic()
    readers[other].proc.send_signal(signal.SIGKILL)
    with pytest.raises(DeadPeerError, match=f"rank {other} on node 'node-a' disconnected"):
        _enqueue_until_error(mq, 30)
    assert time.monotonic() - t_kill < BOUND_S


def test_a_relay_killed_before_the_first_message_leaves_nothing_once_reaped(tmp_path):
    mq = MessageQueue(3, 1, connect_ip="127.0.0.1")
    ring = "/dev/shm" + ring_name(mq.export_handle().name, "node-a")
    path = str(tmp_path / "handle")
    with open(path, "wb") as f:
        pickle.dump(mq.export_handle(), f)
    first = Reader(path, 1, "node-a")  # the node's relay; its node ring is named until the first message
    try:
        first.next("attached")
        assert os.path.exists(ring)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        _core.reap_stale_segments()
        assert not os.path.exists(ring), "the dead relay's ring is reaped"
    finally:
        first.close()
        mq.close()


def test_a_direct_reader_beside_relayed_ones_and_clear_errors_for_bad_nodes(cluster, tmp_path):
    mq, local, readers = cluster({1: "node-a", 2: "node-a", 3: ""})  # "": connect on its own
    assert set(mq.network_stats["relays"]) == {"node-a"}
    for i in range(50):
        mq.enqueue({"i": i})
    mq.shutdown()
    for rank, r in readers.items():
        assert r.next("end")["got"] == list(range(50)), rank
    with pytest.raises(ValueError, match="node id"):
        MessageQueue.create_from_handle(mq.export_handle(), 1, node="a@b")
    assert [local.dequeue(timeout=5)["i"] for _ in range(50)] == list(range(50))
    with pytest.raises(ClosedError):
        local.dequeue(timeout=5)
