"""executor="ray" on a simulated two-node Ray cluster (ray.cluster_utils.Cluster: two raylets on this machine,
each its own node id and resources).

Ray binds the machine's interface address, so the cluster runs in a child process inside a network namespace
that has only loopback (``unshare --net``, then ``lo`` brought up; needs root): every Ray and hotloop socket is then on
127.0.0.1, which the child reports and the tests check. One cluster serves the whole module (Ray starts slowly);
each test sends the child a case to run (this file run as a script, ``--serve-cluster``) and checks its answer.
The reference tokens come from the multiproc executor, in this process.

Nodes: the head (the driver's node) has 2 CPUs; the second node has 2 CPUs and 2 units of a resource "far" the
head lacks, so a rank asking for "far" must go there.
"""

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

import pytest
from conftest import require_torch

require_torch()  # the engine's ranks run a torch model

from hotloop.testing import netns  # noqa: E402

SERVE_FLAG = "--serve-cluster"
RESULT_FD_ENV = "HOTLOOP_RAY_TEST_RESULT_FD"
CASE_TIMEOUT_S = 600  # a case that hangs fails its test (Ray's start-up alone takes ~20 s on 2 busy cores)


def _specs():
    from hotloop.engine import AddRequest
    from hotloop.engine import tokenizer as tk

    prompts = [tk.encode(f"request {i}: " + "abc" * i) for i in range(4)]
    return [AddRequest(f"r{i}", prompts[i], 10 + i, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(4)]


def _serve(core, specs):
    """Run `core` in a thread, feed `specs`, return ({id: [tokens, reason or error]}, the loop's exception)."""
    failure = []

    def run():
        try:
            core.run()
        except BaseException as e:
            failure.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=run)
    t.start()
    for spec in specs:
        core.input_queue.put(spec)
    got = {}
    while sum(1 for v in got.values() if v[2]) < len(specs):
        for o in core.output_queue.get(timeout=120):
            toks, _, _ = got.get(o.request_id, ([], None, False))
            got[o.request_id] = (toks + o.new_token_ids, o.error or o.finish_reason, o.finished)
    core.input_queue.put(None)
    t.join(60)
    assert not t.is_alive(), "the engine loop did not stop"
    return {rid: [toks, reason] for rid, (toks, reason, _) in got.items()}, failure  # reasons: str enums


# ---- the cluster's side (in the network namespace) ----


class _ClusterCases:
    def __init__(self):
        import ray
        from ray.cluster_utils import Cluster

        self.ray = ray
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        self.second = self.cluster.add_node(num_cpus=2, resources={"far": 2})
        ray.init(address=self.cluster.address)
        self.driver_node = ray.get_runtime_context().get_node_id()

    def start(self):
        return {"interfaces": netns.interfaces(),
                "nodes": {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes() if n["Alive"]},
                "driver_node": self.driver_node, "driver_ip": self.ray.util.get_node_ip_address()}

    def _engine(self, **options):
        from hotloop.engine import EngineCore

        step_delay_s = options.pop("step_delay_s", 0.0)
        core = EngineCore("tiny", executor="ray", tp=2, max_tokens_per_step=24, step_delay_s=step_delay_s,
                          executor_options=options)
        ex = core.executor
        bcast, response = ex._bcast.export_handle(), ex._response.export_handle()
        placement = {"nodes": [node for node, _ in ex.nodes], "readers": ex.readers,
                     "bcast": [bcast.n_local_reader, bcast.remote_address],
                     "response": [response.n_local_reader, response.remote_address],
                     "rank_niceness": [os.getpriority(os.PRIO_PROCESS, pid) for pid in ex.pids],
                     "engine_niceness": os.getpriority(os.PRIO_PROCESS, 0)}
        watch = {"actors": [a._actor_id.hex() for a in ex._actors], "pg": ex._pg, "pids": ex.pids}
        return core, placement, watch

    def _leftovers(self, watch, shm_before) -> dict:
        """What the executor's shutdown left: live actors, its placement group, rank processes, segments."""
        from ray._private.state import actors  # the GCS's actor table (the public state API needs the dashboard)
        from ray.util.placement_group import placement_group_table

        deadline = time.monotonic() + 10  # killed actors' processes exit asynchronously
        while True:
            left = {"actors": [a for a in watch["actors"] if actors(a)["State"] != "DEAD"],
                    "placement_group": placement_group_table(watch["pg"])["state"],
                    "processes": [p for p in watch["pids"] if os.path.exists(f"/proc/{p}")],
                    "segments": sorted(_segments(watch["pids"]) - shm_before)}
            left = {k: v for k, v in left.items() if v and v != "REMOVED"}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def tokens(self, join_by_address=False, **options):
        """Serve the specs; with `join_by_address`, this process is disconnected from Ray first and the executor
        joins the cluster by its address (then disconnects at shutdown)."""
        shm = _segments()
        if join_by_address:
            self.ray.shutdown()
            options["address"] = self.cluster.address
        core, placement, watch = self._engine(**options)
        outputs, failure = _serve(core, _specs())
        connected = self.ray.is_initialized()
        if join_by_address:
            self.ray.init(address=self.cluster.address)
        return {"outputs": outputs, "failure": failure, "leftovers": self._leftovers(watch, shm),
                "connected_after_shutdown": connected, **placement}

    def orchestrator_stage(self, **executor_options):
        """An orchestrator LLM stage whose engine process runs executor="ray" (joining this cluster by address),
        and the same stage in-process: the tokens each streamed."""
        import asyncio

        from hotloop.orchestrator import Orchestrator, StageSpec

        async def tokens(options):
            orch = await Orchestrator.start([StageSpec("llm", options={"model": "tiny", **options})])
            try:
                return [t for p in [p async for p in orch.generate("multi-node", max_tokens=12)] for t in p.tokens]
            finally:
                await orch.shutdown()

        ray_options = {"executor": "ray", "tp": 2,
                       "executor_options": {"address": self.cluster.address, **executor_options}}
        return {"ray": asyncio.run(tokens(ray_options)), "inprocess": asyncio.run(tokens({}))}

    def bad_options(self):
        """What each bad option raises, and whether anything was left behind."""
        from hotloop.engine import EngineCore
        from ray.util.placement_group import placement_group_table

        errors = {}
        shm = _segments()
        for name, options in [("strategy", {"placement_strategy": "ANYWHERE"}),
                              ("client", {"address": "ray://127.0.0.1:10001"}),
                              ("unplaceable", {"resources_per_rank": {"CPU": 1, "far": 5}, "start_timeout": 3})]:
            try:
                EngineCore("tiny", executor="ray", tp=2, executor_options=options)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
        live_groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        return {"errors": errors, "live_groups": len(live_groups), "segments": sorted(_segments() - shm)}

    def _fail_mid_step(self, hit, **options):
        """Serve two long requests; once the first tokens are out, `hit(executor)`; return what the requests
        and the loop got, how long after the hit, and what was left."""
        from hotloop.engine import AddRequest

        shm = _segments()
        core, placement, watch = self._engine(step_delay_s=0.2, **options)
        failure = []
        t = threading.Thread(target=lambda: failure.append(_raises(core.run)))
        t.start()
        for i in range(2):
            core.input_queue.put(AddRequest(f"long{i}", [1, 2, 3], 200))
        first = core.output_queue.get(timeout=120)
        t0 = time.monotonic()
        hit(core.executor)
        ended = {}
        while len(ended) < 2:
            for o in core.output_queue.get(timeout=60):
                if o.finished:
                    ended[o.request_id] = [o.finish_reason, o.error]
        elapsed = time.monotonic() - t0
        t.join(60)
        return {"first_finished": first[0].finished, "ended": ended, "elapsed_s": elapsed, "failure": failure,
                "loop_stopped": not t.is_alive(), "leftovers": self._leftovers(watch, shm), **placement}

    def kill_rank(self, rank, **options):
        return self._fail_mid_step(lambda ex: os.kill(ex.pids[rank], signal.SIGKILL), **options)

    def remove_second_node(self, **options):
        return self._fail_mid_step(lambda ex: self.cluster.remove_node(self.second), **options)

    def shutdown(self):
        self.ray.shutdown()
        self.cluster.shutdown()


def _raises(fn):
    try:
        fn()
    except BaseException as e:
        return f"{type(e).__name__}: {e}"
    return None


def _segments(pids=()) -> set:
    """hotloop's /dev/shm segments made by this process or `pids` (the name carries its creator's pid: others
    on this machine make their own)."""
    mine = {str(p) for p in (os.getpid(), *pids)}
    return {f for f in os.listdir("/dev/shm") if f.startswith("hotloop-") and f.split("-")[2] in mine}


def _serve_cluster():
    """The child: run each case read from stdin (one JSON line: [name, kwargs]); answer on the result fd."""
    netns.loopback_up()
    results = os.fdopen(int(os.environ[RESULT_FD_ENV]), "w")
    cases = None
    for line in sys.stdin:
        name, kwargs = json.loads(line)
        if name == "quit":
            break
        try:
            cases = cases or _ClusterCases()
            answer = {"ok": getattr(cases, name)(**kwargs)}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        results.write(json.dumps(answer) + "\n")
        results.flush()
    if cases is not None:
        cases.shutdown()


# ---- the tests' side ----


def _cluster_problem() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'hotloop[ray]')"
    return netns.unavailable()


CLUSTER_PROBLEM = _cluster_problem()
needs_cluster = pytest.mark.skipif(CLUSTER_PROBLEM is not None, reason=f"simulated Ray cluster: {CLUSTER_PROBLEM}")


class _ClusterProcess:
    def __init__(self, log_path):
        self.log_path = log_path
        read, write = os.pipe()
        self._log = open(log_path, "w")
        self.proc = netns.start([sys.executable, os.path.abspath(__file__), SERVE_FLAG], stdin=subprocess.PIPE,
                                stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(write,),
                                env={**os.environ, RESULT_FD_ENV: str(write)}, text=True)
        os.close(write)
        self._results = os.fdopen(read)

    def call(self, name, **kwargs):
        self.proc.stdin.write(json.dumps([name, kwargs]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self._results], [], [], CASE_TIMEOUT_S)
        line = self._results.readline() if ready else ""
        if not line:
            pytest.fail(f"the cluster process gave no answer to {name} (exit code {self.proc.poll()}); "
                        f"its log:\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            pytest.fail(f"{name} failed in the cluster process:\n{answer['error']}\nits log:\n{self.log_tail()}")
        return answer["ok"]

    def log_tail(self, n=60):
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def close(self):
        try:
            self.proc.stdin.write(json.dumps(["quit", {}]) + "\n")
            self.proc.stdin.close()
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session it started: Ray's daemons included
            self.proc.wait()
        self._results.close()
        self._log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = _ClusterProcess(tmp_path_factory.mktemp("ray") / "cluster.log")
    try:
        c.info = c.call("start")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference():
    from hotloop.engine import EngineCore

    outputs, failure = _serve(EngineCore("tiny", executor="multiproc", tp=2, max_tokens_per_step=24), _specs())
    assert not failure
    return json.loads(json.dumps(outputs))


def test_without_ray_the_executor_names_the_extra_to_install():
    code = ("import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
            "from hotloop.engine import EngineCore\n"
            "try:\n    EngineCore('tiny', executor='ray')\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "executor 'ray' cannot be loaded" in out.stdout and "pip install 'hotloop[ray]'" in out.stdout, out


@needs_cluster
def test_the_simulated_cluster_has_two_nodes_on_loopback_only(cluster):
    assert cluster.info["interfaces"] == ["lo"]  # nothing can leave this machine
    assert len(cluster.info["nodes"]) == 2 and set(cluster.info["nodes"].values()) == {"127.0.0.1"}
    assert cluster.info["driver_ip"] == "127.0.0.1"


@needs_cluster
@pytest.mark.parametrize("where", ["same-node", "rank1-on-second-node", "both-on-second-node"])
def test_tp2_gives_the_multiproc_tokens_wherever_the_ranks_run(cluster, reference, where):
    options = {"same-node": {},
               "rank1-on-second-node": {"placement_strategy": "STRICT_SPREAD"},
               "both-on-second-node": {"resources_per_rank": {"CPU": 1, "far": 1}}}[where]
    got = cluster.call("tokens", join_by_address=where == "both-on-second-node", **options)
    assert got["outputs"] == reference and not got["failure"]
    assert got["rank_niceness"] == [got["engine_niceness"]] * 2  # not Ray's 15 for workers
    assert not got["connected_after_shutdown"] if where == "both-on-second-node" else got["connected_after_shutdown"]
    assert all(reason == "length" for _, reason in reference.values())
    driver = cluster.info["driver_node"]
    nodes = [n == driver for n in got["nodes"]]
    if where == "same-node":  # PACK: both on the driver's node, everything in shared memory
        assert nodes == [True, True] and got["bcast"] == [2, None] and got["response"] == [1, None]
    elif where == "rank1-on-second-node":  # rank 0 pinned to the driver's node; rank 1 reads over TCP
        assert nodes == [True, False] and got["readers"] == [0, 1]
        assert got["bcast"][0] == 1 and got["bcast"][1].startswith("tcp://127.0.0.1:")
        assert got["response"] == [1, None]
    else:  # the driver's node cannot hold a rank: every read and rank 0's answers cross nodes
        assert nodes == [False, False] and got["bcast"][0] == 0 and got["response"][0] == 0
        assert got["response"][1].startswith("tcp://127.0.0.1:")
    assert got["leftovers"] == {}


@needs_cluster
def test_an_orchestrator_stage_runs_on_the_ray_executor(cluster):
    got = cluster.call("orchestrator_stage", placement_strategy="STRICT_SPREAD")
    assert len(got["ray"]) == 12 and got["ray"] == got["inprocess"]


@needs_cluster
def test_bad_options_are_refused_and_leave_nothing(cluster):
    got = cluster.call("bad_options")
    assert "placement_strategy must be one of" in got["errors"]["strategy"]
    assert "Ray Client addresses (ray://...) are not supported" in got["errors"]["client"]
    unplaceable = got["errors"]["unplaceable"]
    assert unplaceable.startswith("ExecutorError: Ray could not place 2 ranks of {'CPU': 1, 'far': 5}")
    assert "'far': 10" in unplaceable and "smaller resources_per_rank" in unplaceable
    assert got["live_groups"] == 0 and got["segments"] == []


@needs_cluster
def test_a_rank_killed_mid_step_fails_every_request_naming_it(cluster):
    got = cluster.call("kill_rank", rank=1, placement_strategy="STRICT_SPREAD")
    second_node = got["nodes"][1]
    assert not got["first_finished"] and got["loop_stopped"]
    for reason, error in got["ended"].values():
        assert reason == "engine_dead" and error.startswith("rank 1 (") and second_node in error, error
        assert "died" in error
    assert got["failure"] and got["failure"][0].startswith("ExecutorError: rank 1 (")
    assert got["elapsed_s"] < 10, got["elapsed_s"]  # liveness, not speed: measured ~0.05 s (closing note)
    assert got["leftovers"] == {}


@needs_cluster
def test_removing_a_node_fails_every_request_naming_its_rank(cluster):
    got = cluster.call("remove_second_node", placement_strategy="STRICT_SPREAD")
    second_node = got["nodes"][1]
    for reason, error in got["ended"].values():
        assert reason == "engine_dead" and "rank 1 (" in error and second_node in error, error
    assert got["failure"] and got["loop_stopped"]
    assert got["elapsed_s"] < 30, got["elapsed_s"]
    assert got["leftovers"] == {}


if __name__ == "__main__" and SERVE_FLAG in sys.argv:
    _serve_cluster()
