"""vLLM's AsyncLLM on vLLM's own Ray executor (``--distributed-executor-backend ray``: RayExecutorV2) on a Ray
cluster of simulated nodes (hotloop.testing.ray_cluster), its model on the simulated device; run on the head's
node by ``hotloop.bench.vllm.ray_executor`` (tests/test_vllm_ray.py, ``hotloop bench vllm-ray``).

Protocol: JSON lines on the stdout it was started with (vLLM's and Ray's own output goes to stderr); commands on
stdin, one JSON object a line:

- at start: ``{"ready": true, "workers": [{rank, pid, node, queue, sim_device}], "engine_core": pid}`` once the
  engine serves (``workers`` from every rank: its process, its node's name, the MessageQueue class its executor
  module uses there);
- ``{"cmd": "generate", "n": N, "tokens": T, "seed": S}`` -> ``{"outputs": [[token ids] per prompt]}`` (greedy);
- ``{"cmd": "partition", "n": N}`` -> N long requests; ``{"serving": true, "at": t}`` once each streamed a token,
  then, after the test cut a node, ``{"ended": [[exception type, message, t] per request]}`` (t: CLOCK_MONOTONIC);
- ``{"cmd": "shutdown"}`` -> ``{"shutdown_s": seconds}`` after ``engine.shutdown()`` returned; the driver exits.

Usage: python -m hotloop.bench.vllm.ray_driver MODEL TP NODES
"""

import asyncio
import json
import os
import sys
import time

_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # Ray and vLLM print to fd 1: keep the protocol clean


def say(**msg) -> None:
    _OUT.write(json.dumps(msg) + "\n")


def where(worker=None) -> dict:
    """Runs in each rank (collective_rpc)."""
    mod = sys.modules["vllm.v1.executor.multiproc_executor"]
    runner = getattr(worker, "model_runner", None)
    clock = getattr(getattr(runner, "model", None), "_hotloop_device_clock", None)
    return {"rank": worker.rank, "pid": os.getpid(), "node": os.environ.get("HOTLOOP_NODE_ID"),
            "queue": f"{mod.MessageQueue.__module__}.{mod.MessageQueue.__qualname__}",
            "sim_device": clock is not None}


def _wait_for_nodes(n: int) -> None:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    deadline = time.monotonic() + 120
    while len([x for x in ray.nodes() if x["Alive"]]) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ray.nodes())} of {n} Ray nodes joined")
        time.sleep(0.2)
    ray.shutdown()


async def main(model: str, tp: int) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hotloop.vllm import tiny_model

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, tensor_parallel_size=tp, distributed_executor_backend="ray", dtype="float32",
        max_model_len=1024, max_num_seqs=16, seed=0, enforce_eager=True))
    from hotloop.bench.proc import cmdline, processes

    core = [pid for pid, proc in processes().items() if proc.ppid == os.getpid()
            and any(word in (cmdline(pid) or b"") for word in (b"EngineCore", b"VLLM"))]
    say(ready=True, workers=sorted(await engine.collective_rpc(where), key=lambda w: w["rank"]),
        engine_core=core[0] if core else None)

    async def one(prompt, params, rid, first=None):
        last = None
        async for out in engine.generate(prompt, params, request_id=rid):
            last = out
            if first is not None and not first.done():
                first.set_result(None)
        return list(last.outputs[0].token_ids)

    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    n_req = 0
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=cmd["tokens"], ignore_eos=True)
            prompts = tiny_model.prompts(cmd["n"], seed=cmd.get("seed", 0))
            n_req += 1
            outs = await asyncio.gather(*(one(p, params, f"g{n_req}-{i}") for i, p in enumerate(prompts)))
            say(outputs=outs)
        elif cmd["cmd"] == "partition":
            params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
            firsts = [asyncio.get_running_loop().create_future() for _ in range(cmd["n"])]

            async def doomed(i):
                try:
                    await one(tiny_model.prompts(1, seed=100 + i)[0], params, f"p{i}", firsts[i])
                    return ["finished", "", time.monotonic()]
                except Exception as e:  # noqa: BLE001  (reported: the test checks which)
                    return [type(e).__name__, str(e), time.monotonic()]

            tasks = [asyncio.create_task(doomed(i)) for i in range(cmd["n"])]
            await asyncio.wait_for(asyncio.gather(*firsts), 120)
            say(serving=True, at=time.monotonic())
            say(ended=await asyncio.gather(*tasks))
        elif cmd["cmd"] == "shutdown":
            break
    t0 = time.monotonic()
    engine.shutdown()
    say(shutdown_s=time.monotonic() - t0)


if __name__ == "__main__":
    _wait_for_nodes(int(sys.argv[3]))
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
