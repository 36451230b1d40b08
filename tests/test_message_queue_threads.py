"""hotloop.MessageQueue used from several threads: closing a reader (or a writer) while another thread waits in
it ends that wait with ClosedError, never a crash; a reader's shutdown() wakes its own parked dequeue (vLLM's
workers end their busy loop this way when their parent dies). Over shared-memory and remote readers alike."""

import threading
import time

import pytest

from conftest import thread_parked_in_segment, thread_sleeping, wait_until
from hotloop import ClosedError, FdSource, MessageQueue

LOOPBACK = "127.0.0.1"


@pytest.fixture(params=["local", "remote"])
def queue_pair(request):
    """A writer and its reader rank 0, over shared memory or over TCP on loopback."""
    n_local = 1 if request.param == "local" else 0
    writer = MessageQueue(1, n_local_reader=n_local, connect_ip=LOOPBACK)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    yield writer, reader
    reader.close()
    writer.close()


def _parked_dequeue(reader):
    """Start a thread that parks in reader.dequeue(); returns (thread, outcome list) once it is parked: counted on
    the ring's doorbell (shared memory), asleep in the kernel (a remote reader parks on its descriptor)."""
    source = reader.hotloop_source
    parked_before = source.parked
    outcome = []

    def run():
        try:
            outcome.append(("message", reader.dequeue(timeout=30)))
        except BaseException as e:  # the outcome is what the test checks
            outcome.append(("error", e))

    t = threading.Thread(target=run)
    t.start()
    if isinstance(source, FdSource):
        wait_until(lambda: thread_sleeping(t), what="the remote reader's dequeue parking")
    else:
        wait_until(lambda: source.parked > parked_before, what="the reader's dequeue parking")
    assert t.is_alive() and not outcome
    return t, outcome


@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_closing_or_shutting_down_a_reader_wakes_its_parked_dequeue_with_closed_error(queue_pair, how):
    writer, reader = queue_pair
    t, outcome = _parked_dequeue(reader)
    start = time.monotonic()
    getattr(reader, how)()
    t.join(5)
    assert not t.is_alive(), f"reader.{how}() did not wake the parked dequeue"
    assert time.monotonic() - start < 1.0
    assert outcome[0][0] == "error" and isinstance(outcome[0][1], ClosedError), outcome
    with pytest.raises(ClosedError):
        reader.dequeue(timeout=0)  # later reads too, even with a message waiting
    if how == "shutdown":
        writer.enqueue("after", timeout=5)  # the reader is still attached; the writer is unaffected


def test_a_reader_shut_down_does_not_return_a_message_that_was_waiting(queue_pair):
    writer, reader = queue_pair
    writer.enqueue("waiting", timeout=5)
    reader.shutdown()
    with pytest.raises(ClosedError):
        reader.dequeue(timeout=1)


def test_closing_a_writer_blocked_on_a_full_ring_ends_its_enqueue_with_closed_error():
    writer = MessageQueue(1, max_chunk_bytes=1024)  # a 4 KiB ring
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    outcome = []

    def fill():
        try:
            for _ in range(100):  # the reader never reads: the ring fills and enqueue parks
                writer.enqueue_bytes(b"x" * 512, timeout=30)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=fill)
    t.start()
    # parked on the ring's space doorbell (a futex in the segment), not merely still spinning or between calls
    wait_until(lambda: thread_parked_in_segment(t, writer.name), what="the writer's enqueue parking on a full ring")
    assert t.is_alive() and not outcome
    writer.close()
    t.join(5)
    assert not t.is_alive() and isinstance(outcome[0], ClosedError), outcome
    reader.close()


def test_closing_while_many_threads_wait_never_crashes(queue_pair):
    writer, reader = queue_pair
    threads = [_parked_dequeue(reader) for _ in range(3)]
    reader.close()
    for t, outcome in threads:
        t.join(5)
        assert not t.is_alive() and isinstance(outcome[0][1], ClosedError), outcome
