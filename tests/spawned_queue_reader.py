"""A reader process as vLLM 0.33 starts its workers on CUDA (spawned, the queue handle unpickled in the child), for
tests/test_vllm_queue.py. Its own module so the spawned child imports hotloop.vllm's queue and nothing heavier."""

import pickle

from hotloop.vllm import MessageQueue


def read_all(handle_bytes, rank, count, results):
    """Attach as ``rank``, read ``count`` messages ``{"i": ...}`` and put ``(rank, [i, ...])`` on ``results``
    (``(rank, "error: ...")`` instead of hanging the writer)."""
    try:
        q = MessageQueue.create_from_handle(pickle.loads(handle_bytes), rank)
        q.wait_until_ready(timeout=60)
        got = [q.dequeue(indefinite=True)["i"] for _ in range(count)]
        results.put((rank, got))
        q.close()
    except BaseException as e:  # noqa: BLE001
        results.put((rank, f"error: {e!r}"))
