"""``hotloop soak --minutes 1``: the whole stack under chaos for a minute; every must-be-0 row of its record is 0.
``hotloop soak --network``: the same with the queues on simulated nodes under network faults (root only)."""

import json
import subprocess
import sys

import pytest
from conftest import require_torch

require_torch()


def test_one_minute_soak_loses_duplicates_hangs_and_leaks_nothing(tmp_path):
    record = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "hotloop.cli", "soak", "--minutes", "1", "--seed", "1",
                           "--json", str(record)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=240)
    assert record.exists(), f"no record (exit code {proc.returncode}):\n{proc.stderr[-4000:]}"
    rec = json.loads(record.read_text())
    table = proc.stdout
    rows = {f"{r['section']}: {r['name']}": r["value"] for r in rec["rows"]}
    # the run did something: traffic flowed and chaos killed processes
    assert rows["queue: messages sent (all writers)"] > 0 and rows["engine: good requests finished"] > 0, table
    assert rows["orchestrator: good requests finished"] > 0 and rec["kills"], table
    nonzero = {f"{r['section']}: {r['name']}": r["value"] for r in rec["rows"] if r["must_be_zero"] and r["value"]}
    assert nonzero == {}, f"must-be-0 rows are not 0: {nonzero}\n{table}"
    assert rec["ok"] or rec["goal_missed"], table  # a missed kill-to-error goal is reported, not asserted here


def test_network_soak_detects_every_partition_within_the_bound_and_loses_nothing(tmp_path):
    """``hotloop soak --network --sustained-loss 2`` for 45 s: every reader node loses 2 % of its packets each way
    for the whole run, and a network fault comes every ~2 s (the first ones cover every kind): each partition is
    seen by the writer and the cut-off reader within the bound; the steady loss, a short cut, 2 % loss more and
    20 ms delay lose, duplicate, reorder, hang and leak nothing, and end no live connection (an unexpected error)."""
    from hotloop.testing.netns import Nodes

    if Nodes.unavailable():
        pytest.skip(Nodes.unavailable())
    record = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "hotloop.cli", "soak", "--network", "--sustained-loss", "2",
                           "--minutes", "0.75", "--seed", "2", "--network-interval-s", "2", "--json", str(record)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert record.exists(), f"no record (exit code {proc.returncode}):\n{proc.stderr[-4000:]}"
    rec = json.loads(record.read_text())
    table = proc.stdout
    assert rec["config"]["sustained_loss_percent"] == 2 and "losing 2 % of its packets each way" in table, table
    rows = {f"{r['section']}: {r['name']}": r["value"] for r in rec["rows"]}
    nonzero = {f"{r['section']}: {r['name']}": r["value"] for r in rec["rows"] if r["must_be_zero"] and r["value"]}
    assert nonzero == {}, f"must-be-0 rows are not 0: {nonzero}\n{table}"
    for kind in ("partition", "short cut", "2 % loss", "delay 20 ms +- 5 ms"):
        assert rows[f"network: {kind}: injected"] >= 1, f"no {kind!r} injected\n{table}"
    partitions = [f for f in rec["network_faults"] if f["kind"] == "partition"]
    bound = rec["network_bound_s"]
    for f in partitions:
        assert set(f["detected_s"]) == {"writer", "reader"}, f
        assert max(f["detected_s"].values()) <= bound, f
    for f in rec["network_faults"]:  # every fault's generation ended with its processes' descriptors counted
        assert f["fds_left"] == 0 and f["fds_reported"] >= 1, f
    assert rows["queue: messages sent (all writers)"] > 0, table


@pytest.mark.parametrize("args,what", [(["--sustained-loss", "2"], "--sustained-loss needs --network"),
                                       (["--no-delay-proxy"], "--no-delay-proxy needs --network"),
                                       (["--network", "--sustained-loss", "100"], "a % in [0, 100)")])
def test_network_options_without_what_they_need_are_refused_with_why(args, what):
    proc = subprocess.run([sys.executable, "-m", "hotloop.cli", "soak", "--minutes", "0.1", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 2 and what in proc.stderr, (proc.returncode, proc.stderr)


def test_a_relay_stopped_by_the_kill_of_a_reader_of_its_node_is_documented_not_lost():
    # the DeadPeerError a node's reader gets when its relay abandons the node's ring (shm_ring.cpp's words); the
    # relay runs in pid 1196, the reader killed was pid 1197
    from types import SimpleNamespace

    from hotloop.soak.queue_load import _lost_its_relay

    abandoned = ("the writer (pid 1196) of queue /hotloop-node-4026531836-06d6c01b9f0dd055aeab639f548282a1 lost its "
                 "own source (a node's relay lost the queue's writer); every message it received was delivered: "
                 "recreate the queue")
    died = "the writer (pid 1197) of queue /hotloop-node-4026531836-06d6c01b9f0dd055aeab639f548282a1 died"
    report = {"end": "dead_peer", "error": abandoned}
    relayed, relay = SimpleNamespace(pid=1197), SimpleNamespace(pid=1196)
    assert _lost_its_relay(report, relayed, killed_on_its_node=True)  # another reader of the node: the relay stopped
    assert not _lost_its_relay(report, relayed, killed_on_its_node=False)  # a kill elsewhere does not explain it
    assert _lost_its_relay({"end": "dead_peer", "error": died}, relayed, killed_on_its_node=False)  # the relay killed
    assert not _lost_its_relay(report, None, killed_on_its_node=False)  # no kill: unexplained
    assert not _lost_its_relay({"end": "closed", "error": ""}, relayed, killed_on_its_node=True)
    direct = {"end": "dead_peer", "error": "the writer (pid 1196) of queue /hotloop-q-1 died"}
    assert not _lost_its_relay(direct, relay, killed_on_its_node=True)  # not a node's ring
