"""vLLM across nodes: vLLM's own Ray executor (RayExecutorV2) on a Ray cluster of two simulated nodes, on vLLM's own
queue or on hotloop's, its model on the simulated device (``hotloop.vllm.sim_device``; the nodes declare their
devices to Ray: ``hotloop.vllm.sim_platform``).

Contract:

- ``Deployment(tp, queue, log_dir, env=None, placement="split")`` makes the nodes (network namespaces joined by
  veth links, ``hotloop.testing.netns``), a Ray cluster on them (``ray_cluster``), and starts ``ray_driver``
  on the head's node: an AsyncLLM whose engine core is the executor. ``placement`` (PLACEMENTS): "split", two
  nodes ("head", "far") with ``tp // 2`` devices each: rank 0 (and rank 1 at TP=4) on the head's node with the
  engine core, the other half on the far node; "driver-alone", three nodes, the head with no device and "far",
  "far2" with ``tp // 2`` each: vLLM puts the driver's node's ranks first, then orders the other nodes by Ray
  node id, so rank 0 is on "far" or "far2", never with the engine core. ``queue`` is "hotloop"
  (``HOTLOOP_VLLM=1`` in every process of every node) or "vllm". ``start()`` returns the driver's ready line
  (each rank's pid, node and queue class); ``generate(n, tokens)`` greedy token ids; ``partition(n, rank)``
  starts n long requests, cuts the node of rank ``rank`` (default: the last rank, never on the head's node) once
  each streamed a token, and returns when every request ended (``{"cut_at", "node", "ended": [[type, message,
  t]]}``); ``shutdown()`` the seconds ``engine.shutdown()`` took; ``stranger()`` connects a plain (no CURVE)
  ZeroMQ SUB socket, from the head's node, to every queue port (hotloop's queues: the addresses they log; vLLM's:
  every port the engine's processes listen on) and returns how many messages it got while the engine served
  requests, and how many refusals hotloop's writers logged meanwhile; ``logs()`` the driver's and every Ray
  worker's output; ``left()`` what is left of the engine (rank processes alive on any node, hotloop /dev/shm
  segments of its processes).
  ``queue_addresses()`` the addresses hotloop's queues publish on (their writers log them).
  ``close()`` kills everything left in the nodes and removes them.
- ``main()`` (``python -m hotloop.bench.vllm.ray_executor``, ``hotloop bench vllm-ray``) prints the comparison:
  outputs per queue at TP=2 (1 + 1) and TP=4 (2 + 2), the time from a cut to every request's error over ``--cuts``
  cuts (on hotloop's queue: rank 1's node with rank 0 on the driver's, and rank 0's node with the driver alone on
  its own), and the stranger's count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time

from hotloop.bench.proc import alive, cmdline
from hotloop.bench.report import Report, percentile, print_result, table
from hotloop.testing.netns import Nodes
from hotloop.testing.ray_cluster import RayCluster

SIM_DEVICE = "1300+2"
QUEUES = ("vllm", "hotloop")
PLACEMENTS = ("split", "driver-alone")


def _described(pid: int) -> str:
    """A live process for a report: its pid, its state letter (/proc/PID/stat) and its command line."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"{pid} (gone while read)"
    line = cmdline(pid)
    if line is None:
        return f"{pid} (gone while read)"
    text = line.replace(b"\0", b" ").decode(errors="replace").strip()
    return f"{pid} {state} {text[:200]}"


class Deployment:
    def __init__(self, tp: int, queue: str, log_dir: str, env: dict | None = None, placement: str = "split"):
        if tp not in (2, 4):
            raise ValueError(f"tp must be 2 (1 + 1) or 4 (2 + 2), got {tp}")
        if queue not in QUEUES:
            raise ValueError(f"queue must be one of {QUEUES}, got {queue!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        from hotloop.vllm import tiny_model

        self.tp, self.queue = tp, queue
        self.model = tiny_model.build(0, heads=4 if tp == 4 else 2)
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"vllm-ray-tp{tp}-{queue}-{placement}.log")
        self._log = open(self.log_path, "a")
        base = {**(env if env is not None else os.environ), "HOTLOOP_VLLM": "1" if queue == "hotloop" else "0",
                "HOTLOOP_VLLM_SIM_DEVICE": SIM_DEVICE, "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        names = ["head", "far"] if placement == "split" else ["head", "far", "far2"]
        self.nodes = Nodes(names)
        devices = {name: tp // 2 for name in names if placement == "split" or name != "head"}
        try:
            self.cluster = RayCluster(self.nodes, self._log, gpus=devices, env=base)
        except BaseException:
            self.nodes.close()
            raise
        self.driver = None
        self.ready: dict = {}
        self._shm_before: set = set()

    # ---- the driver ----

    def start(self, timeout: float = 300) -> dict:
        self._shm_before = set(os.listdir("/dev/shm"))
        self.driver = self.nodes.popen(
            "head", [sys.executable, "-m", "hotloop.bench.vllm.ray_driver", self.model, str(self.tp),
                     str(len(self.nodes.ns))],
            env=self.cluster.driver_env("head"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True)
        self.ready = self._line(timeout)
        if not self.ready.get("ready"):
            raise RuntimeError(f"vLLM did not start on the Ray cluster; see {self.log_path}")
        return self.ready

    def _send(self, **cmd) -> None:
        self.driver.stdin.write(json.dumps(cmd) + "\n")
        self.driver.stdin.flush()

    def _line(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.driver.stdout], [], [], timeout)
        return json.loads(self.driver.stdout.readline() or "{}") if ready else {}

    def generate(self, n: int = 4, tokens: int = 24, timeout: float = 120) -> list[list[int]]:
        self._send(cmd="generate", n=n, tokens=tokens)
        got = self._line(timeout)
        if "outputs" not in got:
            raise RuntimeError(f"generate did not answer: {got}; see {self.log_path}")
        return got["outputs"]

    def partition(self, n: int = 4, rank: int | None = None, timeout: float = 180, heal: bool = True) -> dict:
        """n long requests; the node of `rank` (default: the last rank's) cut once each streamed a token; returns
        when all ended, healed then unless `heal` is False (the caller heals ``self.nodes.heal(got["node"])``; a
        failure heals at once). Healed at once, the executor's ``ray.kill`` may reach a cut rank before that rank's
        own timer ends it (so it leaves no line of its own)."""
        node = self.ready["workers"][self.tp - 1 if rank is None else rank]["node"]
        if node == "head":
            raise ValueError(f"rank {rank} is on the head's node, with the engine core: cut a rank on another node")
        self._send(cmd="partition", n=n)
        serving = self._line(120)
        if not serving.get("serving"):
            raise RuntimeError(f"the requests did not start: {serving}; see {self.log_path}")
        cut_at = time.monotonic()
        self.nodes.cut(node)
        got = {}
        try:
            got = self._line(timeout)
        finally:
            if heal or "ended" not in got:
                self.nodes.heal(node)
        if "ended" not in got:
            raise RuntimeError(f"the requests did not end within {timeout} s of the cut; see {self.log_path}")
        return {"cut_at": cut_at, "node": node, "ended": got["ended"]}

    def shutdown(self, timeout: float = 120) -> float | None:
        self._send(cmd="shutdown")
        got = self._line(timeout)
        try:
            self.driver.wait(30)
        except subprocess.TimeoutExpired:
            pass
        return got.get("shutdown_s")

    # ---- what can be seen from outside ----

    def listening_ports(self) -> dict[str, list[int]]:
        """Per node, the TCP ports the engine's processes (engine core, ranks) listen on."""
        pids = {w["pid"] for w in self.ready["workers"]} | {self.ready.get("engine_core")}
        out = {}
        for node, ns in self.nodes.ns.items():
            text = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnpH"], capture_output=True,
                                  text=True).stdout
            ports = set()
            for row in text.splitlines():
                owners = {int(p) for p in re.findall(r"pid=(\d+)", row)}
                if owners & pids:
                    ports.add(int(row.split()[3].rsplit(":", 1)[1]))
            out[node] = sorted(ports)
        return out

    def stranger(self, listen_s: float = 3.0) -> dict:
        """A plain SUB socket on every port the engine listens on, subscribed to everything, while the engine
        serves: {"ports": {addr: port list}, "received": messages it got}."""
        targets = self.queue_addresses() or [f"tcp://{self.nodes.addr[node]}:{p}"
                                             for node, ports in self.listening_ports().items() for p in ports]
        refused = self.logs().count("refused a connection")
        code = ("import sys, time, zmq\n"
                "ctx = zmq.Context(); socks = []\n"
                "for a in sys.argv[2:]:\n"
                "    s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b''); s.connect(a); socks.append(s)\n"
                "poller = zmq.Poller(); [poller.register(s, zmq.POLLIN) for s in socks]\n"
                "got, end = 0, time.monotonic() + float(sys.argv[1])\n"
                "while time.monotonic() < end:\n"
                "    for s, _ in poller.poll(100):\n"
                "        s.recv_multipart(); got += 1\n"
                "print(got)\n")
        proc = self.nodes.popen("head", [sys.executable, "-c", code, str(listen_s), *targets],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # deliberate: the stranger's handshakes are under way before the engine sends
        self.generate(4, 48)
        received = int(proc.communicate(timeout=listen_s + 30)[0].strip() or -1)
        return {"targets": targets, "received": received,
                "refused": self.logs().count("refused a connection") - refused}

    def queue_addresses(self) -> list[str]:
        """The addresses hotloop's queues publish on to readers on other nodes (their writers log them)."""
        return sorted(set(re.findall(r"connect to (tcp://[0-9.]+:\d+) \(CurveZMQ", self.logs())))

    def logs(self) -> str:
        """The driver's output (vLLM's engine core included) and every Ray worker's log on both nodes."""
        parts = [open(self.log_path, errors="replace").read()]
        for root, _, files in os.walk(self.cluster.temp):
            for f in files:
                if f.startswith("worker-") and f.endswith((".out", ".err")):
                    parts.append(open(os.path.join(root, f), errors="replace").read())
        return "\n".join(parts)

    def left(self, within_s: float = 10.0) -> dict:
        """Rank processes still alive (waited for up to `within_s`), each as "pid state command line" (so a failed
        check says what stayed), and hotloop /dev/shm segments made by the engine's processes."""
        pids = [w["pid"] for w in self.ready.get("workers", [])]
        pids += [p for p in (self.ready.get("engine_core"), self.driver.pid if self.driver else None) if p]
        deadline = time.monotonic() + within_s
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        mine = {str(p) for p in pids}
        segments = [f for f in os.listdir("/dev/shm") if f.startswith("hotloop-") and len(f.split("-")) > 2
                    and (f.split("-")[2] in mine or (f.startswith("hotloop-node-") and f not in self._shm_before))]
        segments += [f for f in os.listdir("/dev/shm")
                     if f.startswith("hotloop.devclock.") and f not in self._shm_before]
        return {"alive": [_described(p) for p in pids if alive(p)], "segments": sorted(segments)}

    def close(self) -> None:
        if self.driver is not None:
            if self.driver.poll() is None:
                self.driver.kill()
                self.driver.wait()
            for pipe in (self.driver.stdin, self.driver.stdout):
                if pipe is not None:
                    pipe.close()
        self.cluster.close()
        self.nodes.close()
        self._log.close()

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def error_after_cut(result: dict) -> float:
    """Seconds from the cut until the last request ended."""
    return max(t for _, _, t in result["ended"]) - result["cut_at"]


# ---- the benchmark ----


CUT_CASES = {  # data["cuts"] key: (queue, placement, the rank whose node is cut, what the table calls it)
    "hotloop": ("hotloop", "split", 1, "rank 1's node, rank 0 with the driver"),
    "hotloop-rank0": ("hotloop", "driver-alone", 0, "rank 0's node, the driver alone on its node"),
    "vllm": ("vllm", "split", 1, "rank 1's node, rank 0 with the driver"),
}


def _named(logs: str, rank: int, addr: str) -> int:
    """How many of hotloop's failure lines name `rank` and the node at `addr`."""
    return sum(f"hotloop: rank {rank} (Ray node" in ln and f" at {addr})" in ln for ln in logs.splitlines())


def _cut_rounds(case: str, cuts: int, log_dir: str, env: dict, fresh_each: bool) -> dict:
    """`cuts` partitions of a rank's node (CUT_CASES[case]) at TP=2, each on a new engine (and a new cluster when
    `fresh_each`: after a long cut Ray has given the node up for good)."""
    queue, placement, rank, _ = CUT_CASES[case]
    after, kinds, named, left, shutdown = [], set(), [], [], []
    d = None
    try:
        for i in range(cuts):
            if d is None or fresh_each:
                if d is not None:
                    d.close()
                d = Deployment(2, queue, log_dir, env, placement)
            ready = d.start()
            addr = d.nodes.addr[ready["workers"][rank]["node"]]
            before = _named(d.logs(), rank, addr)
            got = d.partition(4, rank, timeout=400)
            after.append(error_after_cut(got))
            kinds |= {e[0] for e in got["ended"]}
            named.append(_named(d.logs(), rank, addr) > before)
            shutdown.append(d.shutdown())
            left.append(d.left())
            print(f"{case}, cut {i + 1}/{cuts}: every request ended {after[-1]:.2f} s after the cut "
                  f"({', '.join(sorted({e[0] for e in got['ended']}))}), named {named[-1]}, left {left[-1]}",
                  file=sys.stderr, flush=True)
    finally:
        if d is not None:
            d.close()
    return {"after_cut_s": after, "p50_s": percentile(after, 50), "p99_s": percentile(after, 99),
            "max_s": max(after), "errors": sorted(kinds), "named": all(named), "shutdown_s": shutdown,
            "left": left, "clean": all(x == {"alive": [], "segments": []} for x in left)}


def _cut_table(cuts: dict) -> str:
    rows = [[CUT_CASES[c][0], CUT_CASES[c][3], f"{r['p50_s']:.2f}", f"{r['p99_s']:.2f}", f"{r['max_s']:.2f}",
             len(r["after_cut_s"]), ", ".join(r["errors"]), "yes" if r["named"] else "no",
             "nothing" if r["clean"] else json.dumps(r["left"][-1])] for c, r in cuts.items()]
    return table("A rank's node cut mid-request at TP=2 (one rank a node): seconds from the cut until every request "
                 "failed", ["queue", "node cut", "p50 s", "p99 s", "max s", "cuts", "requests ended with",
                        "rank and node named", "left after shutdown"], rows)


def _cut_goals(cuts: dict) -> list[dict]:
    hotloop = [r for c, r in cuts.items() if CUT_CASES[c][0] == "hotloop"]
    p99 = max(r["p99_s"] for r in hotloop)
    detail = "; ".join(f"{CUT_CASES[c][3]}: p99 {r['p99_s']:.2f} s over {len(r['after_cut_s'])} cuts"
                       for c, r in cuts.items() if CUT_CASES[c][0] == "hotloop")
    if "vllm" in cuts:
        detail += f" (vLLM's own queue: {cuts['vllm']['p50_s']:.1f} s)"
    return [{"goal": "a cut rank node fails every request within 5 s (p99), naming rank and node",
             "met": p99 <= 5.0 and all(r["named"] and r["errors"] == ["EngineDeadError"] for r in hotloop),
             "detail": detail},
            {"goal": "nothing left on any node after shutdown or a failure", "met": all(r["clean"] for r in hotloop),
             "detail": "nothing left" if all(r["clean"] for r in hotloop)
             else json.dumps([r["left"] for r in hotloop])}]


def run_cuts(cuts: int = 3, cases: tuple = ("hotloop", "hotloop-rank0"),
             log_dir: str | None = None) -> tuple[dict, str]:
    """Only the cuts of `cases` (CUT_CASES; default both on hotloop's queue):
    ``python -m hotloop.bench.vllm.ray_executor --cuts-only [--case CASE ...]``."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="hotloop-vllm-ray-")
    data: dict = {"log_dir": log_dir, "cuts": {}}
    for case in cases:
        data["cuts"][case] = _cut_rounds(case, cuts, log_dir, dict(os.environ), fresh_each=False)
    data["goals"] = _cut_goals(data["cuts"])
    return data, str(Report([_cut_table(data["cuts"])]))


def run(quick: bool = True, cuts: int | None = None, vllm_cuts: int = 1, log_dir: str | None = None,
        broadcast: bool = True) -> tuple[dict, str]:
    cuts = cuts or (3 if quick else 20)
    log_dir = log_dir or tempfile.mkdtemp(prefix="hotloop-vllm-ray-")
    env = dict(os.environ)
    data: dict = {"log_dir": log_dir, "identical": {}, "stranger": {}, "cuts": {}}
    report = Report()
    for tp in (2, 4):
        outs = {}
        for queue in QUEUES:
            with Deployment(tp, queue, log_dir, env) as d:
                d.start()
                outs[queue] = d.generate(4, 24)
                if tp == 2:
                    data["stranger"][queue] = d.stranger()
                d.shutdown()
        data["identical"][str(tp)] = outs["vllm"] == outs["hotloop"]
    for case in ("hotloop", "hotloop-rank0"):
        data["cuts"][case] = _cut_rounds(case, cuts, log_dir, env, fresh_each=False)
    # vLLM's own: rank 0 waits in the simulated device's TP barrier for 10 min (as in NCCL's collective), so what
    # ends the requests is vLLM's own supervision (Ray's verdict on the far node)
    data["cuts"]["vllm"] = _cut_rounds("vllm", vllm_cuts, log_dir, {**env, "HOTLOOP_VLLM_SIM_DEVICE_BARRIER_S": "600"},
                                       fresh_each=True)
    report.append(_cut_table(data["cuts"]))
    rows = [[q, len(r["targets"]), r["received"], r["refused"] if q == "hotloop" else "-"]
            for q, r in data["stranger"].items()]
    report.append(table("A plain ZeroMQ SUB socket (no keys) on every queue port while the engine serves",
                        ["queue", "ports tried", "messages it got", "refusals logged"], rows))
    report.append("Greedy outputs identical on both queues: "
                  + ", ".join(f"TP={tp}: {'yes' if same else 'NO'}" for tp, same in data["identical"].items()))
    goals = [{"goal": f"greedy outputs identical at TP={tp} on two nodes", "met": same,
              "detail": "identical" if same else "differ"} for tp, same in data["identical"].items()]
    cut_goal, left_goal = _cut_goals(data["cuts"])
    goals.append(cut_goal)
    goals.append({"goal": "a stranger on any queue port gets no message and is counted",
                  "met": data["stranger"]["hotloop"]["received"] == 0 and data["stranger"]["hotloop"]["refused"] > 0,
                  "detail": f"got {data['stranger']['hotloop']['received']}, refusals logged "
                            f"{data['stranger']['hotloop']['refused']} (vLLM's own queue: got "
                            f"{data['stranger']['vllm']['received']})"})
    goals.append(left_goal)
    if broadcast:
        from hotloop.bench.vllm import broadcast as vllm_broadcast

        bdata, btext = vllm_broadcast.run(quick)
        data["broadcast"] = bdata
        report.append(btext)
        goals += bdata["goals"]
    data["goals"] = goals
    return data, str(report)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="vLLM's Ray executor on two simulated nodes, on vLLM's queue and on "
                                             "hotloop's")
    ap.add_argument("--full", action="store_true", help="20 cuts on hotloop's queue (default 3)")
    ap.add_argument("--cuts", type=int)
    ap.add_argument("--vllm-cuts", type=int, default=1, help="cuts on vLLM's own queue (each about a minute)")
    ap.add_argument("--cuts-only", action="store_true", help="only the cuts (--case; default both on hotloop's queue)")
    ap.add_argument("--case", action="append", choices=[c for c in CUT_CASES if CUT_CASES[c][0] == "hotloop"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cuts_only:
        data, text = run_cuts(args.cuts or (20 if args.full else 3), tuple(args.case or ("hotloop", "hotloop-rank0")))
    else:
        data, text = run(not args.full, args.cuts, args.vllm_cuts)
    return print_result("vllm-ray", data, text, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
