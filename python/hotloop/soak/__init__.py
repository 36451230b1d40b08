"""``hotloop soak``: the whole stack under load for N minutes while processes are killed, stopped and fed garbage.

Contract:

- Load, all on loopback (127.0.0.1) unless ``--network`` (below), and all at once:
  - ``QueueGroup``: a writer process with shared-memory readers and remote (TCP) readers of one MessageQueue
    (``n_local_reader < n_reader``). Each message is ``(writer id, generation, sequence, crc32, payload)``, its
    size random (up to several times the ring). Readers block in ``dequeue`` and check every message: none lost,
    none duplicated, in order, checksum good. A kill ends the queue's *generation*; the group then recreates
    the queue and its processes, so traffic continues for the whole run.
  - ``EngineLoad``: an ``AsyncEngineClient`` engine (executor "multiproc", model "tiny") serving a stream of
    requests, some of them bad (NaN or tiny temperatures, out-of-vocabulary ids, wrong types, ...). A bad request
    may be rejected by the client (ValueError / TypeError, "at the edge") or by the engine (RequestError); both
    are clear errors. Restarted when it dies.
  - ``OrchestratorLoad``: an Orchestrator with two LLM replicas feeding a transform replica, the same request mix;
    a dead replica is replaced (``add_replica``).
- ``Chaos`` (seeded): at random moments SIGKILLs a random process (queue writer or reader, engine, engine worker,
  replica), or SIGSTOPs it for 0.1-2 s and SIGCONTs it, or connects raw TCP / ZeroMQ sockets to a queue's
  publisher port and sends garbage (which must not disturb the readers).
- ``Report``: after the run (and a grace period that bounds every outcome), a table on stdout; progress on
  stderr; ``--json`` writes the record. Rows marked ``must be 0``: messages lost, duplicated, out of order or
  corrupt on surviving readers; unexpected queue errors; requests hung (no terminal outcome within HANG_S of
  their previous output) or failed without a kill to explain it; engine deaths and replica evictions no kill
  explains; leaked /dev/shm/hotloop-* entries, child processes and file descriptors of this process. The time
  from each kill to the survivors' error (writer: DeadPeerError for a dead reader; readers: DeadPeerError for a
  dead writer; the client: EngineDeadError; the orchestrator: the request's ReplicaDeadError) is reported as
  p50 / p99 / max against a goal (1 s by default). The exit code is 1 when a ``must be 0`` row is not 0 or the
  goal is missed (``--no-fail-on-goal`` reports the goal without failing on it), else 0.
- ``--network`` (``SoakNodes``, ``NetworkChaos``; root, iproute2, nftables): the queue groups' writers and
  shared-memory readers on one simulated node, each remote reader on its own, and network faults on the
  readers' nodes next to the process chaos: partitions longer than the peer timeout (the writer and the cut-off
  reader must raise DeadPeerError within ``HOTLOOP_PEER_TIMEOUT_S`` + 5 s), short cuts healed in time, 2 % loss
  and 20 ms +- 5 ms delay (which must raise, lose, duplicate or reorder nothing). The report gains a section per
  fault kind and the partition-to-error percentiles. The engine and the orchestrator stay on loopback.
- Not covered: raw frames to an engine's input socket (its address is not part of the public API), the blocking
  ``EngineClient``, tensor parallelism > 1, the engine and the orchestrator across nodes, the poll orchestrator
  loop.

The package, one part per file, each importing only the ones before it: ``own_processes`` (pids, children,
segments, descriptors, percentiles), ``nodes`` (``SoakNodes``), ``findings`` (``Findings``: the kills, counts and
findings the loads and the chaos record; ``Kill``), ``net_fault`` (``NetFault``, the fault kinds), ``chaos``
(``Chaos``, ``Target``, ``send_garbage``), ``request_load`` (``EngineLoad``, ``OrchestratorLoad``), ``queue_load``
(``QueueGroup``), ``network_chaos`` (``NetworkChaos``), ``report`` (``Report``, a ``Findings`` that builds the
table), ``driver`` (``Soak``, ``run``).
"""

from hotloop.soak.chaos import Chaos, Target, send_garbage
from hotloop.soak.driver import Soak, run
from hotloop.soak.findings import Kill
from hotloop.soak.net_fault import KINDS as NETWORK_FAULT_KINDS
from hotloop.soak.net_fault import NetFault
from hotloop.soak.network_chaos import NetworkChaos
from hotloop.soak.nodes import SoakNodes
from hotloop.soak.own_processes import (CTX, HANG_S, LOOPBACK, START_TIMEOUT_S, children_of, descendants_of,
                                        open_fds, percentiles, send_signal, shm_entries)
from hotloop.soak.queue_load import QueueGroup, ReaderTotals
from hotloop.soak.report import MUST_BE_ZERO, Report
from hotloop.soak.request_load import (BAD_REQUESTS, CLEAR_REJECTIONS, EngineLoad, OrchestratorLoad, RequestTally)

__all__ = ["BAD_REQUESTS", "CLEAR_REJECTIONS", "CTX", "HANG_S", "LOOPBACK", "MUST_BE_ZERO", "NETWORK_FAULT_KINDS",
           "START_TIMEOUT_S", "Chaos", "EngineLoad", "Kill", "NetFault", "NetworkChaos", "OrchestratorLoad",
           "QueueGroup", "ReaderTotals", "Report", "RequestTally", "Soak", "SoakNodes", "Target", "children_of",
           "descendants_of", "open_fds", "percentiles", "run", "send_garbage", "send_signal", "shm_entries"]
