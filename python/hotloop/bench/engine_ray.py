"""The Ray rows of ``hotloop bench engine``: tensor-parallel engines (tp=2, hotloop wait mode) on a simulated
two-node Ray cluster (``ray.cluster_utils.Cluster``), next to the multiproc executor at tp=2 in the same place:

- ``multiproc tp=2``: the baseline;
- ``ray tp=2 one node``: both ranks on the driver's node (PACK): every read in shared memory;
- ``ray tp=2 rank 1 on node 2``: STRICT_SPREAD: rank 1 reads each step over CurveZMQ TCP (loopback here) and the
  all-reduce crosses "nodes" through gloo's TCP.

Every rank runs one torch thread (``OMP_NUM_THREADS=1``, what Ray gives an actor of one CPU).

This module is the child process that runs them: ``python -m hotloop.bench.engine_ray '<params as JSON>'``, which
``hotloop bench engine`` (engine_bench.py) starts in a loopback-only network namespace (``hotloop.testing.netns``;
root), so nothing leaves the machine. It starts the cluster, runs the same workloads as the other rows
(``engine_workloads.one_engine``) and prints its figures as JSON on its last line: {label: [runs, idle]}. The
engine joins the cluster through ``$RAY_ADDRESS``.

CPU: the engine's processes are the engine process's tree plus the ranks' Ray worker processes (found by their
process title ``ray::_Rank``: children of the raylets, not of the engine); Ray's own daemons (GCS, raylets and
their helpers: every other process under the child) are reported apart, idle only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from hotloop.bench.engine_workloads import engine_tree_cpu, one_engine
from hotloop.bench.proc import cmdline, descendants, processes
from hotloop.bench.report import Progress

ROWS = {  # label -> engine arguments
    "multiproc tp=2": {"executor": "multiproc", "tp": 2},
    "ray tp=2 one node": {"executor": "ray", "tp": 2, "executor_options": {"placement_strategy": "PACK"}},
    "ray tp=2 rank 1 on node 2": {"executor": "ray", "tp": 2,
                                  "executor_options": {"placement_strategy": "STRICT_SPREAD"}},
}
RANK_TITLE = b"ray::_Rank"  # Ray names an actor's process after its class


def _cpu_of(engine_pid: int):
    """({engine tree, each rank}: CPU s, {Ray's daemons}: CPU s) for an engine in this process's cluster."""
    me = os.getpid()

    def cpu():
        procs = processes()
        engine = set(descendants(procs, engine_pid))
        ranks = sorted(p for p in descendants(procs, me) if (cmdline(p) or b"").startswith(RANK_TITLE))
        ours = {"engine and workers": sum(procs[p].cpu_s for p in engine)}
        ours.update({f"rank process {pid}": procs[pid].cpu_s for pid in ranks if pid not in engine})
        daemons = sum(procs[p].cpu_s for p in descendants(procs, me) if p not in engine and p not in ranks and p != me)
        return ours, {"ray daemons": daemons}

    return cpu


def _main(p: dict) -> None:
    from hotloop.testing import netns

    netns.loopback_up()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    os.environ["RAY_ADDRESS"] = cluster.address  # the engine processes join it
    # Ray runs an actor of one CPU with one torch thread; the multiproc baseline gets the same (with the default,
    # two ranks x all cores of threads oversubscribe a small machine: 4 instead of 350 tok/s measured on 2 cores)
    os.environ["OMP_NUM_THREADS"] = "1"
    progress = Progress("bench engine, ray rows", len(ROWS) * p["repeats"])
    got = {}
    try:
        for label, engine in ROWS.items():
            engine = dict(engine)
            executor = engine.pop("executor")
            cpu_of = _cpu_of if executor == "ray" else engine_tree_cpu
            got[label] = asyncio.run(one_engine(executor, "hotloop", p, progress, "cpu", cpu_of, **engine))
    finally:
        progress.close()
        cluster.shutdown()
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
