"""RayExecutor: the ranks as Ray actors on any node of a Ray cluster, driven through hotloop MessageQueues
(WorkerGroupExecutor's contract; the worker loop is worker.py's). Ray only places and supervises the ranks: the
step broadcast and rank 0's answers never pass through Ray.

Contract:

- Cluster: joins the cluster at ``address`` (else ``$RAY_ADDRESS``; Ray's own rule) or starts a local one, unless
  this process is connected to Ray already; what it connected it disconnects at shutdown (a local cluster it
  started stops with it).
- Placement: a placement group of one bundle per rank (``resources_per_rank``: {"CPU": 1} on the CPU,
  {"GPU": 1, "CPU": 1} on CUDA) with ``placement_strategy`` "PACK" (default), "SPREAD", "STRICT_SPREAD" or
  "STRICT_PACK". Bundle 0, rank 0's, is pinned to the driver's node (Ray's node-id label) when that node can hold
  a bundle at all. Whether a rank is local is decided by the Ray node id of its bundle, never by its address.
- Control plane: the step broadcast is one MessageQueue whose low reader indices go to the ranks on the driver's
  node (shared memory) and the rest to the other ranks (CurveZMQ over TCP to the driver node's Ray address);
  rank 0 answers on a queue of its own, shared memory when it is on the driver's node, TCP from its node's Ray
  address otherwise. torch.distributed meets at rank 0's node address (gloo on the CPU, NCCL on CUDA). The
  engine waits on the response reader and the ``failed`` flag in its one ``wait_any``.
- Supervision: a thread blocks on the actors' ``run`` futures (no timer). Ray resolves a future with an error when
  the actor's process or node dies or the rank raises, and the executor fails naming the rank, its node id and
  address; measured on a simulated cluster: 20 ms after an actor's SIGKILL, at once after a node is removed.
- Partitions: Ray learns of a node that stopped answering only from its health checks (~15 s by default), so each
  rank also holds a liveness link with the engine (liveness.py: one TCP connection carrying heartbeats each way,
  given up when nothing arrived for ``HOTLOOP_PEER_TIMEOUT_S``, default 3 s). A link that times out fails the
  executor naming the rank and its node (measured 2.3-3.1 s from the cut to every request's error; when rank 0
  is the one cut off, its answers' connection may time out first, and the engine waits for the link's verdict:
  worker_group's REPORT_GRACE_S); a rank whose link to the engine is lost ends its own process, wherever it is
  blocked (a gloo all-reduce with the lost peer would wait for gloo's timeout, 30 min by default). gloo's timeout
  is left alone: it also bounds waits for a rank that is only slow, and it would fail a collective, not name the
  rank that was cut off.
- ``shutdown()``: the broadcast queue's shutdown ends every rank's loop (each closes its queues), then the actors
  are killed and the placement group removed; no actor, process or /dev/shm segment is left. After a failure
  the actors are killed at once (a rank may be blocked in a collective with the lost one), and the futures of
  ranks that stopped answering are not waited for (Ray resolves them only when it gives up on their node).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import socket
import threading

try:
    import ray
except ImportError as e:
    raise ImportError(f"executor='ray' needs Ray ({e}): pip install 'hotloop[ray]'") from e
from ray.util.placement_group import (NODE_ID_LABEL_KEY, placement_group, placement_group_table,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hotloop import MessageQueue
from hotloop.engine.executors import liveness
from hotloop.engine.executors.worker import serve_steps, start_rank
from hotloop.engine.executors.worker_group import STEP_CHUNK_BYTES, WorkerGroupExecutor
from hotloop.engine.model import ModelConfig
from hotloop.errors import ExecutorError

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
STOP_GRACE_S = 5  # a rank's loop ends within one step of the broadcast's shutdown; then its actor is killed
DEATH_REPORT_S = 0.5  # after a rank raised: how long to wait for Ray to report a peer's death (see _supervise)


class _Rank:
    """One tensor-parallel rank in a Ray actor: ``start`` joins the group and attaches the queues, ``run`` serves
    steps until the broadcast queue shuts down (its future is what the engine supervises)."""

    def where(self) -> tuple[int, str, str]:
        """(pid, Ray node id, node address) of this rank."""
        return os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def hold_engine_link(self, token: bytes, timeout: float) -> int:
        """Listen for the engine's liveness link on this node's address (its port returned); once the link is lost,
        this process exits, wherever its threads are blocked (see liveness)."""
        listener = liveness.listen(ray.util.get_node_ip_address())
        threading.Thread(target=liveness.hold, args=(listener, token, timeout, _exit_without_engine),
                         name="hotloop-engine-link", daemon=True).start()
        return listener.getsockname()[1]

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def start(self, rank: int, world_size: int, config: ModelConfig, init_method: str, step_delay_s: float,
              device: str, backend: str | None, bcast_handle, reader: int, response_ip: str | None, niceness: int):
        """Take the engine's `niceness`, join, build the runner, attach reader `reader` of the broadcast; rank 0
        returns its response handle (a TCP queue advertised at `response_ip` when the engine is on another node,
        else shared memory)."""
        _renice(niceness)
        self.runner = start_rank(rank, world_size, config, init_method, step_delay_s, device, backend)
        # Ranks on one Ray node share the broadcast's stream through that node's relay (named by Ray's node id).
        self.bcast = MessageQueue.create_from_handle(bcast_handle, reader,
                                                     node=ray.get_runtime_context().get_node_id())
        self.response = None
        if rank == 0:
            self.response = MessageQueue(1, 0 if response_ip else 1, max_chunk_bytes=STEP_CHUNK_BYTES,
                                         connect_ip=response_ip)
            return self.response.export_handle()
        return None

    def run(self, start_timeout: float) -> None:
        try:
            if self.response is not None:
                self.response.wait_until_ready(start_timeout)
            serve_steps(self.runner, self.bcast, self.response)
        finally:
            if self.response is not None:
                self.response.close()
            self.bcast.close()


def _exit_without_engine(why: str | None) -> None:
    """A rank whose engine is gone or closed its link ends its process: it may be blocked in a collective with a
    rank that is cut off too, and nobody else can reach it to stop it."""
    if why is not None:
        print(f"hotloop rank (pid {os.getpid()}): lost the engine ({why}); exiting", flush=True)
    os._exit(1)


def _renice(niceness: int) -> None:
    """Give every thread of this process `niceness` (Linux keeps one per thread; threads made later inherit it).

    Ray starts its workers at niceness 15 (its ``worker_niceness``), so on a busy machine a rank yields its CPU to
    everything else and every step waits for it: measured on 2 busy shared cores, decode at 0.67x multiproc's
    with Ray's 15, 0.88x (inside the run-to-run spread) with the engine's 0.
    Lowering it needs CAP_SYS_NICE; without, the rank says so and keeps Ray's."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except PermissionError:
            print(f"hotloop rank: cannot lower this process's niceness to the engine's ({niceness}); start the "
                  "Ray nodes with RAY_worker_niceness=0 for ranks that do not yield to other work", flush=True)
            return


def _death(e: BaseException) -> str:
    """Ray's explanation of a rank's end, in one line."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = str(e.cause).strip().splitlines() or [""]
        return f"raised {type(e.cause).__name__}: {cause[0]}"
    lines = [ln.strip() for ln in str(e).splitlines()]
    why = [ln.split(". ")[0].rstrip(".") for ln in lines if " because " in ln or "terminated" in ln]
    return f"its actor died ({'; '.join(why) or lines[0]})"


class RayExecutor(WorkerGroupExecutor):
    def __init__(self, config: ModelConfig, tp: int = 1, step_delay_s: float = 0.0, device: str = "cpu",
                 address: str | None = None, placement_strategy: str = "PACK",
                 resources_per_rank: dict | None = None, start_timeout: float = 180):
        """``device``: resolved ("cpu", "cuda" or "cuda:N"): on CUDA each rank uses the GPU of its bundle."""
        if placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {placement_strategy!r}")
        if step_delay_s and device != "cpu":
            raise ValueError("step_delay_s (a test aid: the worker sleeps in each step) works on device='cpu' only")
        if str(address or os.environ.get("RAY_ADDRESS", "")).startswith("ray://"):
            raise ValueError("Ray Client addresses (ray://...) are not supported: the engine shares memory with the "
                             "ranks on its node, so run it on a node of the cluster and join by the cluster's "
                             "address (host:6379)")
        cuda = device.startswith("cuda")
        bundle = dict(resources_per_rank or ({"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}))
        if cuda and not bundle.get("GPU"):
            raise ValueError(f"device {device!r} needs a GPU in every rank's bundle, got resources_per_rank={bundle}")
        self._pg = None
        self._actors: list = []
        self._runs: list = []
        self.where: list[tuple[int, str, str]] = []  # (pid, node id, address) of each rank
        self._supervisor = None
        self._stop_supervising: concurrent.futures.Future = concurrent.futures.Future()
        self._links = liveness.LinkWatcher(self._lost)
        self._unreachable: set[int] = set()  # ranks whose node stopped answering: their futures may never resolve
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray and address is None and not os.environ.get("RAY_ADDRESS"):
            ray.init(include_dashboard=False)  # a local cluster, for this engine
        elif self._owns_ray:
            ray.init(address=address)
        try:
            self.nodes = self._place(tp, bundle, placement_strategy, start_timeout)
        except BaseException:
            self._release_placement()
            raise
        driver_node = ray.get_runtime_context().get_node_id()
        # broadcast reader index of each rank: the driver node's ranks first (shared memory), then the others
        order = sorted(range(tp), key=lambda r: (self.nodes[r][0] != driver_node, r))
        self.readers = [order.index(r) for r in range(tp)]
        n_local = sum(node == driver_node for node, _ in self.nodes)
        super().__init__(tp, device, n_local, connect_ip=ray.util.get_node_ip_address() if n_local < tp else None)
        try:
            self._start(config, step_delay_s, device, bundle, driver_node, start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="hotloop-ray-supervisor", daemon=True)
        self._supervisor.start()
        self._links.start()

    def _place(self, tp: int, bundle: dict, strategy: str, timeout: float) -> list[tuple[str, str]]:
        """Reserve one bundle per rank; (node id, node address) of each rank's bundle."""
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        fits = all(nodes[driver_node]["Resources"].get(k, 0) >= v for k, v in bundle.items())
        selectors = [{NODE_ID_LABEL_KEY: driver_node}] + [{}] * (tp - 1) if fits else None
        self._pg = placement_group([bundle] * tp, strategy=strategy, bundle_label_selector=selectors)
        if not self._pg.wait(timeout):
            total = {k: v * tp for k, v in bundle.items()}
            raise ExecutorError(f"Ray could not place {tp} ranks of {bundle} each ({strategy}) within {timeout} s: "
                                f"the cluster has {ray.cluster_resources()} in all, this group needs {total}; add "
                                "nodes, or pass a smaller resources_per_rank or another placement_strategy")
        placed = placement_group_table(self._pg)["bundles_to_node_id"]
        return [(placed[r], nodes[placed[r]]["NodeManagerAddress"]) for r in range(tp)]

    def _start(self, config, step_delay_s: float, device: str, bundle: dict, driver_node: str, timeout: float):
        actor = ray.remote(_Rank)
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        for r in range(self.tp):
            self._actors.append(actor.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=extra or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
            ).remote())
        self.where = self._gather([a.where.remote() for a in self._actors], "report where it runs", timeout)
        token = secrets.token_bytes(32)
        ports = self._gather([a.hold_engine_link.remote(token, timeout) for a in self._actors],
                             "listen for the engine's link", timeout)
        for r, port in enumerate(ports):
            self._links.connect(r, self.nodes[r][1], port, token, timeout)
        port = self._gather([self._actors[0].free_port.remote()], "pick a rendezvous port", timeout)[0]
        init_method = f"tcp://{self.nodes[0][1]}:{port}"
        cuda = device.startswith("cuda")
        rank_device, backend = ("cuda:0", "nccl") if cuda else (device, None)  # Ray shows each rank its own GPU
        response_ip = None if self.nodes[0][0] == driver_node else self.nodes[0][1]
        handles = self._gather([a.start.remote(r, self.tp, config, init_method, step_delay_s, rank_device, backend,
                                               self._bcast.export_handle(), self.readers[r], response_ip,
                                               os.getpriority(os.PRIO_PROCESS, 0))
                                for r, a in enumerate(self._actors)], "start", timeout)
        self._connect(handles[0], timeout)
        self._runs = [a.run.remote(timeout) for a in self._actors]

    def _gather(self, refs: list, what: str, timeout: float) -> list:
        """Every rank's answer; ExecutorError naming the first rank that failed or did not answer in time."""
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for r, ref in enumerate(refs):
            if ref in pending:
                raise ExecutorError(f"rank {r} did not {what} within {timeout} s ({self._rank_name(r)})")
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                raise ExecutorError(f"rank {r} ({self._rank_name(r)}) failed to {what}: {_death(e)}") from e
        return ray.get(refs)

    def _rank_name(self, rank: int) -> str:
        node, ip = self.nodes[rank]
        pid = f"pid {self.where[rank][0]}, " if self.where else ""
        return f"{pid}node {node} at {ip}"

    def _describe(self, rank: int) -> str:
        return f"rank {rank} ({self._rank_name(rank)})"

    def _supervise(self) -> None:
        """Block until a rank's ``run`` future resolves (or shutdown stops this): fail naming it."""
        runs = {run.future(): run for run in self._runs}
        stop = self._stop_supervising
        done, pending = concurrent.futures.wait([stop, *runs], return_when=concurrent.futures.FIRST_COMPLETED)
        if self._stopping or stop in done:
            return
        # A rank that died before one that raised when both are in (a rank raises when it lost a peer in a
        # collective): the first named is the one that died, however the two reports were ordered on their way here.
        outcomes = sorted((self._outcome(runs[f]) for f in runs if f in done), key=lambda o: o[0])
        why = "; ".join(w for _, w in outcomes)
        if any(raised for raised, _ in outcomes) and len(pending) > 1:
            # A rank that raised often lost a peer in a collective; Ray reports the peer's death itself a few ms
            # later (20 ms measured after a SIGKILL), so wait that long to name the rank that died first.
            more, _ = concurrent.futures.wait(pending, timeout=DEATH_REPORT_S,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            why = "; ".join([self._outcome(runs[f])[1] for f in runs if f in more] + [why])
        self._fail(f"{why}; the engine cannot run more steps")

    def _lost(self, rank: int, why: str) -> None:
        """Rank's liveness link timed out: its node is cut off (Ray's own verdict comes only after its health
        checks, ~15 s by default)."""
        self._unreachable.add(rank)
        self._fail(f"rank {rank} ({self._rank_name(rank)}): {why}; the engine cannot run more steps")

    def _outcome(self, run) -> tuple[bool, str]:
        """(whether the rank raised, what happened) for a rank's finished ``run`` future."""
        rank = self._runs.index(run)
        raised = False
        try:
            ray.get(run)
            why = "stopped serving (its loop lost the engine's queue)"
        except ray.exceptions.RayError as e:
            raised, why = isinstance(e, ray.exceptions.RayTaskError), _death(e)
        return raised, f"rank {rank} ({self._rank_name(rank)}): {why}"

    def _stop_workers(self) -> None:
        # the future of a rank on a node that stopped answering resolves only when Ray gives up on the node
        reachable = [run for r, run in enumerate(self._runs) if r not in self._unreachable]
        if reachable and not self.failed.is_set():  # the broadcast's shutdown ends each loop within a step
            ray.wait(reachable, num_returns=len(reachable), timeout=STOP_GRACE_S)
        # after a failure at once: a rank may be blocked in a collective with a lost peer for gloo's whole timeout
        for a in self._actors:
            ray.kill(a)
        if reachable:
            ray.wait(reachable, num_returns=len(reachable), timeout=STOP_GRACE_S)
        self._links.close()  # a rank still running (cut off) exits once it sees its link lost
        self._stop_supervising.set_result(None)
        if self._supervisor is not None:
            self._supervisor.join()
        self._actors, self._runs = [], []
        self._release_placement()

    def _release_placement(self) -> None:
        """Remove the placement group and disconnect from Ray if this executor connected."""
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    @property
    def pids(self) -> list[int]:
        """The ranks' processes (on their own nodes: a pid names a process on the node of that rank)."""
        return [pid for pid, _, _ in self.where] if self._actors else []
