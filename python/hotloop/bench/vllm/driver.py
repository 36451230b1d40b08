"""The offline ``LLM.generate`` harness of the vLLM tests and of ``hotloop bench vllm``'s batch rows: one engine of one
arm in a driver process of its own (``python -m hotloop.bench.vllm.driver``), MultiprocExecutor, the tiny model.

``Driver(tp, arm, model, env_extra)`` starts the process (the arm's environment, ``arms.arm_env``) and blocks until
its engine is ready (it answers the queue class, the simulated device and the readers' waits of each worker);
``generate(batch, max_tokens)`` runs one burst and returns its wall time, token ids and CPU (or the error vLLM
raised); ``idle_cpu()`` the tree's idle CPU; ``close()`` stops the process and kills what of its group outlived it,
and returns those stragglers. One caller at a time: the protocol is one JSON line each way per command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

from hotloop.bench.proc import process_tree_cpu_seconds, tree
from hotloop.bench.vllm.arms import arm_env, worker_queue_class, worker_reader_wait, worker_sim_device
from hotloop.bench.vllm.processes import idle_cpu

OUTPUT_TOKENS = 64


def _driver(args) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep the protocol channel clean

    def say(**msg):
        proto.write(json.dumps(msg) + "\n")

    from vllm import LLM, SamplingParams

    from hotloop.vllm import tiny_model

    llm = LLM(model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend="mp", dtype="float32",
              max_model_len=512, max_num_seqs=16, seed=0, enforce_eager=True, gpu_memory_utilization=0.5)
    queue_class = sorted(set(llm.collective_rpc(worker_queue_class)))
    say(ready=True, pid=os.getpid(), queue_class=queue_class, sim_device=llm.collective_rpc(worker_sim_device),
        reader_wait=llm.collective_rpc(worker_reader_wait))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", OUTPUT_TOKENS), ignore_eos=True)
            prompts = tiny_model.prompts(cmd["batch"], seed=cmd.get("seed", 0))
            t0 = time.perf_counter()
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            except Exception as e:  # reported (tests read it); the engine is unusable after most errors
                say(error=f"{type(e).__module__}.{type(e).__qualname__}", message=str(e)[:500],
                    after_s=time.perf_counter() - t0)
                continue
            wall = time.perf_counter() - t0
            say(wall_s=wall, token_ids=[list(o.outputs[0].token_ids) for o in outs])
        elif cmd["cmd"] == "exit":
            break
    say(bye=True)
    return 0


class Driver:
    """The bench side of a driver process: start, send bursts, read results, stop."""

    def __init__(self, tp: int, arm: str, model: str, env_extra: dict | None = None):
        """env_extra: variables set in the driver's environment over the arm's; a value None removes one."""
        env = {k: v for k, v in {**arm_env(tp, arm), **(env_extra or {})}.items() if v is not None}
        self.tp, self.arm = tp, arm
        self.log = open(os.devnull, "w") if not os.environ.get("HOTLOOP_BENCH_VERBOSE") else None
        self.proc = subprocess.Popen([sys.executable, "-m", "hotloop.bench.vllm.driver", "--tp", str(tp), "--model",
                                      model], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, start_new_session=True)
        ready = self._read()
        self.pid = self.proc.pid
        self.queue_class = ready["queue_class"]
        self.sim_device = ready["sim_device"]  # per worker: the simulated device's figures, or None
        self.reader_wait = ready["reader_wait"]  # per worker: its readers' waits [(kind, cap_us, why)]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"vLLM driver (TP={self.tp}, arm {self.arm}) exited with code {rc} before answering; "
                               "rerun with HOTLOOP_BENCH_VERBOSE=1 to see its log")
        return json.loads(line)

    def generate(self, batch: int, max_tokens: int = OUTPUT_TOKENS) -> dict:
        """One burst: {"wall_s", "token_ids", "cpu_s"}, or {"error", "message", "after_s"} when vLLM raised."""
        c0 = process_tree_cpu_seconds(self.pid)
        self.proc.stdin.write(json.dumps({"cmd": "generate", "batch": batch, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        out["cpu_s"] = process_tree_cpu_seconds(self.pid) - c0
        return out

    def processes(self) -> dict[int, str]:
        """The driver's process tree: pid -> command line."""
        return tree(self.pid)

    def idle_cpu(self, windows=((0.0, 3.0), (5.0, 8.0))) -> list[tuple[float, float]]:
        """CPU of the tree, and of its gloo loop threads, in percent of one core over each window (seconds after
        now)."""
        return idle_cpu(self.pid, windows)

    def close(self) -> dict[int, str]:
        """Stop the driver; then SIGKILL whatever of its process group outlived it (a vLLM worker can: see
        docs/vllm.md) and return those stragglers (pid -> command line)."""
        tracked = self.processes()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        def left():
            found = {}
            for pid, cmd in tracked.items():
                try:
                    if pid != self.proc.pid and os.getpgid(pid) == self.proc.pid:
                        found[pid] = cmd
                except OSError:
                    continue
            return found

        deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits a moment after its clients
        while (stragglers := left()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            if f is not None:
                f.close()
        return stragglers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotloop.bench.vllm.driver", description="one engine of a Driver")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model", required=True)
    return _driver(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
