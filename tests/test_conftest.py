"""The leak fixture's reading of /dev/shm names (conftest.own_segments): a segment counts as this test's when this
process or a descendant made it, or its maker died; a node relay ring, whose name carries its PID namespace and
not a pid (hotloop/queue/relay.py), counts by the writer pid in its header."""

import contextlib
import os
import struct
import subprocess
import uuid

import pytest

from conftest import _LAYOUT_MAGIC, own_segments, segment_creator
from hotloop.queue.relay import ring_name


def _start_time(pid: int) -> int:
    """Process `pid`'s start time as the ring's header records its writer's (shm_ring.cpp): 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return 0 if fields[0] in "ZX" else int(fields[19])


@pytest.fixture
def fake_node_ring():
    """Makes /dev/shm files named as relay.ring_name names them, with a ring header whose writer is `pid` (and its
    start time, as a live writer's ring has: the reaper of any other hotloop process on the machine, which runs
    whenever one makes a queue, leaves the ring of a live writer alone; a dead writer's it may remove first)."""
    made = []

    def make(writer_pid: int) -> str:
        name = ring_name(f"leak-test-{uuid.uuid4().hex}", "node-a").lstrip("/")
        header = struct.pack("<QIIQQIiQ", _LAYOUT_MAGIC, 3, 1, 4096, 1024, 0, writer_pid, _start_time(writer_pid))
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(header + bytes(256))
        made.append(name)
        return name

    yield make
    for name in made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_a_node_ring_of_a_live_process_outside_the_test_is_not_the_tests(fake_node_ring):
    name = fake_node_ring(1)  # init: alive, and no descendant of this test
    assert segment_creator(name) == (os.stat("/proc/self/ns/pid").st_ino, 1)
    assert name not in own_segments(), "the namespace number in the name was read as the creator's pid"


def test_a_node_ring_written_by_this_process_or_a_dead_one_is_the_tests(fake_node_ring):
    own = fake_node_ring(os.getpid())
    child = subprocess.Popen(["true"])
    child.wait()
    orphan = fake_node_ring(child.pid)  # its writer is gone: a leak of this test
    mine = own_segments()
    assert own in mine
    # counted while it is there: the reaper of another hotloop process running beside this one (another test
    # suite) may remove a dead writer's ring at any moment
    assert orphan in mine or not os.path.exists(f"/dev/shm/{orphan}"), mine


def test_a_node_ring_whose_header_is_not_written_yet_is_nobodys():
    name = ring_name(f"leak-test-{uuid.uuid4().hex}", "node-a").lstrip("/")
    open(f"/dev/shm/{name}", "wb").close()  # a ring being created: its header is not there yet
    try:
        assert segment_creator(name) is None and name not in own_segments()
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_a_queue_ring_is_read_by_the_pid_in_its_name():
    ns = os.stat("/proc/self/ns/pid").st_ino
    assert segment_creator(f"hotloop-{ns}-{os.getpid()}-123-0-0badcafe") == (ns, os.getpid())
    assert segment_creator("hotloop.devclock.1") is None
    assert segment_creator("hotloop-node-x-abc") is None
