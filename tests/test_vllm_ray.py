"""vLLM across nodes: vLLM's own Ray executor (``--distributed-executor-backend ray``, RayExecutorV2) on a Ray cluster
of simulated nodes (network namespaces joined by veth links; hotloop.bench.vllm.ray_executor), on vLLM's own queue
and on hotloop's, the model on the simulated device.

Checked, at TP=4 with the ranks split between two nodes (two a node, rank 0 with the engine core; the far node's
ranks share one stream through hotloop's relay), one cluster start a queue: greedy outputs identical on both
queues; with HOTLOOP_VLLM=1 every rank on hotloop's MessageQueue (the executor's module there) and the plugin's line
from the engine core and every rank, on both nodes; then, on the same engine: a plain ZeroMQ SUB socket (no CURVE
keys) on every queue port gets no message while the engine serves, and the writer counts its refused handshake
(vLLM's own queue hands such a socket every step: ``hotloop bench vllm-ray``); the far node cut mid-request fails
every request with vLLM's EngineDeadError within BOUND_S, the engine core's log naming a far rank and its node,
the far ranks end their own processes, shutdown returns, and neither node keeps a rank process or a /dev/shm
segment of the engine. (The cut was a TP=2 engine of its own before: one engine start less.) Rank 0's node cut,
with the engine core alone on its node (placement
"driver-alone"), runs in ``hotloop bench vllm-ray`` (``--cuts-only``): in CI its engine once failed to start, its
two ranks on two simulated nodes of one machine colliding on vLLM's CPU shared-memory communicator
("create shm in SHMManager failed. errno: 17").
"""

import pytest

from conftest import require_supported_vllm, wait_until

require_supported_vllm()

from hotloop.testing import ray_cluster  # noqa: E402

pytestmark = pytest.mark.skipif(ray_cluster.unavailable() is not None,
                                reason=f"simulated Ray nodes: {ray_cluster.unavailable()}")

from hotloop.bench.vllm.ray_executor import Deployment, error_after_cut  # noqa: E402

BOUND_S = 5.0  # from the cut to every request's error (hotloop's peer timeout is 3 s)
PLUGIN_LINE = "runs on hotloop's MessageQueue"


def _check_ready(d: Deployment, tp: int, queue: str) -> dict:
    ready = d.start()
    assert [w["node"] for w in ready["workers"]] == ["head"] * (tp // 2) + ["far"] * (tp // 2), ready
    assert all(w["sim_device"] for w in ready["workers"]), ready
    assert {w["queue"] for w in ready["workers"]} == {QUEUES[queue]}, ready
    return ready


QUEUES = {"vllm": "vllm.distributed.device_communicators.shm_broadcast.MessageQueue",
          "hotloop": "hotloop.vllm.message_queue.MessageQueue"}


def test_two_nodes_outputs_on_both_queues_then_a_stranger_and_a_cut_node_on_hotloops(tmp_path):
    """TP=4, two ranks a node. vLLM's queue: the reference outputs. hotloop's, on one cluster start: the same
    outputs and the plugin's line from every process; a stranger's SUB socket gets nothing; the far node cut fails
    every request within BOUND_S, naming a far rank and its node; the far ranks end; nothing is left."""
    tp = 4
    with Deployment(tp, "vllm", str(tmp_path / "vllm")) as d:
        _check_ready(d, tp, "vllm")
        ref = d.generate(4, 24)
        assert d.shutdown() is not None
        assert d.left() == {"alive": [], "segments": []}
    assert len(ref) == 4 and all(len(o) == 24 for o in ref)

    with Deployment(tp, "hotloop", str(tmp_path / "hotloop")) as d:
        ready = _check_ready(d, tp, "hotloop")
        assert d.generate(4, 24) == ref
        pids = {str(w["pid"]) for w in ready["workers"]} | {str(ready["engine_core"])}
        said = {ln.split("in process ")[1].split(";")[0] for ln in d.logs().splitlines() if PLUGIN_LINE in ln}
        assert pids <= said, f"processes without the plugin's line: {pids - said}"

        seen = d.stranger()
        assert seen["targets"], "no queue address in the logs"
        assert seen["received"] == 0, seen
        assert seen["refused"] >= 1, seen

        far = {w["rank"]: w["pid"] for w in ready["workers"] if w["node"] == "far"}
        got = d.partition(4, heal=False)
        try:
            after = error_after_cut(got)
            print(f"every request failed {after:.2f} s after the cut")
            assert [e[0] for e in got["ended"]] == ["EngineDeadError"] * 4, got["ended"]
            assert after <= BOUND_S, f"the requests failed {after:.2f} s after the cut"
            logs = d.logs()
            named = [ln for ln in logs.splitlines() if any(f"hotloop: rank {r} (Ray node" in ln for r in far)]
            assert named and "did not answer" in named[0] and f"at {d.nodes.addr['far']}:" not in named[0], named
            assert f"at {d.nodes.addr['far']})" in named[0], named[0]
            # the cut ranks end on their own timers, which run out about when the engine core's does; the node stays
            # cut meanwhile: healed at once, the executor's ray.kill reached one far rank before its timer (CI, a
            # far rank without its line after 30 s). Ray runs ranks at niceness 15: at load average 6 one did not
            # log within 10 s.
            for pid in far.values():
                said = f"rank process {pid} lost its executor"
                wait_until(lambda: said in d.logs(), 30, f"the far rank's line {said!r}")
        finally:
            d.nodes.heal(got["node"])
        assert d.shutdown() is not None
        # the ranks' processes get 30 s to end: with 10 s this check failed once in 7 runs at load average ~25,
        # what was left not recorded
        assert d.left(within_s=30) == {"alive": [], "segments": []}
