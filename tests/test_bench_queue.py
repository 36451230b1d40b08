"""hotloop bench queue's round trip against vLLM's own queue (python/hotloop/bench/queue_bench.py): the echo child
ends in os._exit, so whatever its queues hold must be released before it; a vLLM writer left to the exit kept its
segment in /dev/shm until the parent's resource tracker removed it ("leaked shared_memory objects")."""

import os

from conftest import require_supported_vllm


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("psm_")}


def test_a_round_trip_on_vllms_queue_leaves_no_segment_behind():
    require_supported_vllm()
    from hotloop.bench import queue_bench

    before = _segments()
    got = queue_bench._round_trip(queue_bench._VllmQueue, 64, rounds=50, warmup=5)
    assert 0 < got["p50_us"] <= got["p99_us"], got
    left = _segments() - before
    assert not left, f"vLLM queue segments left after the run: {sorted(left)}"
