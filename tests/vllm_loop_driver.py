"""A vLLM AsyncLLM engine (TP=1, multiprocess executor) on hotloop's queue, driven through inputs that arrive while a
step runs; tests/test_vllm_loop.py runs it in a child process with HOTLOOP_VLLM_LOOP=1 or 0 and reads the JSON line
it prints last.

The worker's steps are slowed (a sleep of STEP_S before each execute_model, installed through collective_rpc) so
that "during a step" is a wide window: each input below is sent once a step is known to be running (the request's
previous token has just been streamed, and the next step starts at once).

Usage: python vllm_loop_driver.py MODEL {shutdown,kill}
"""

import asyncio
import json
import os
import signal
import sys
import time

STEP_S = 0.6
TOKENS = 8


def slow_steps(worker, delay):
    """Runs in the worker (collective_rpc): sleep `delay` s before each execute_model."""
    import time as _time

    inner = worker.execute_model

    def slow(*args, **kwargs):
        _time.sleep(delay)
        return inner(*args, **kwargs)

    worker.execute_model = slow
    return os.getpid()


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(p))
            except (OSError, ValueError, IndexError):
                pass
    return out + [c for p in out for c in children(p)]


def cmdline(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def main(model: str, ending: str) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hotloop.vllm import tiny_model

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, tensor_parallel_size=1, distributed_executor_backend="mp", dtype="float32", max_model_len=512,
        max_num_seqs=16, seed=0, enforce_eager=True))
    core = engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompts = tiny_model.prompts(4, seed=3)
    res = {}
    loop = os.environ.get("HOTLOOP_VLLM_LOOP") == "1"

    async def run(i, rid, first=None):
        last = None
        async for out in engine.generate(prompts[i], params, request_id=rid):
            last = out
            if first is not None and not first.done():
                first.set_result(time.monotonic())
        return list(last.outputs[0].token_ids), last.outputs[0].finish_reason

    # reference outputs, fast steps
    res["reference"] = [(await run(i, f"ref{i}"))[0] for i in range(3)]
    await core.call_utility_async("hotloop_queue_waits")  # forget the reference requests' waits
    worker_pids = await engine.collective_rpc(slow_steps, args=(STEP_S,))

    # A runs; B is added during one of A's steps; a utility call is made during the next; then C (added during
    # a step, still waiting) and A (running) are aborted during steps.
    first = asyncio.get_running_loop().create_future()
    a = asyncio.create_task(run(0, "A", first))
    await first
    await asyncio.sleep(STEP_S / 4)  # A's second step is running
    t_b = time.monotonic()
    b = asyncio.create_task(run(1, "B"))
    await asyncio.sleep(STEP_S / 4)
    t0 = time.monotonic()
    await engine.is_sleeping()  # a utility call
    res["utility_s"] = time.monotonic() - t0
    if loop:
        res["utility_in_step"] = (await core.call_utility_async("hotloop_loop_state"))["in_step"]
    res["a_b"] = await asyncio.gather(a, b)
    res["b_started_s"] = t_b

    first = asyncio.get_running_loop().create_future()
    a = asyncio.create_task(run(0, "A2", first))
    await first
    await asyncio.sleep(STEP_S / 4)
    c = asyncio.create_task(run(2, "C"))  # arrives during A2's step: waiting, not yet scheduled
    await asyncio.sleep(STEP_S / 8)
    await engine.abort("C")
    await engine.abort("A2")
    await asyncio.sleep(STEP_S / 8)
    if loop:
        res["after_aborts_in_step"] = (await core.call_utility_async("hotloop_loop_state"))["in_step"]
    for task, name in ((a, "A2"), (c, "C")):
        try:
            res[f"{name}_end"] = await asyncio.wait_for(task, 30)
        except Exception as e:  # noqa: BLE001  (AsyncLLM ends an aborted stream its own way)
            res[f"{name}_end"] = [None, type(e).__name__]
    res["waits"] = await core.call_utility_async("hotloop_queue_waits")
    if loop:
        state = await core.call_utility_async("hotloop_loop_state")
        res["unfinished_after"], res["inputs_in_step"] = state["unfinished"], state["inputs_in_step"]
        res["outputs"] = state["outputs"]
        res["inputs_read_by_main"] = state["inputs_read_by_main"]

    # the engine still answers, with the same tokens
    await engine.collective_rpc(slow_steps, args=(0.0,))
    res["after"] = [(await run(i, f"after{i}"))[0] for i in range(3)]

    tree = [p for p in children(os.getpid()) if "VLLM" in cmdline(p)]  # not multiprocessing's resource tracker
    res["tree"] = {p: cmdline(p) for p in tree}
    await engine.collective_rpc(slow_steps, args=(STEP_S,))
    first = asyncio.get_running_loop().create_future()
    d = asyncio.create_task(run(0, "D", first))
    await first
    await asyncio.sleep(STEP_S / 4)
    t0 = time.monotonic()
    if ending == "kill":
        os.kill(worker_pids[0], signal.SIGKILL)
        try:
            await asyncio.wait_for(d, 60)
            res["kill"] = "no error"
        except Exception as e:  # noqa: BLE001
            res["kill"] = type(e).__name__
        res["kill_to_error_s"] = time.monotonic() - t0
        engine.shutdown()
    else:
        engine.shutdown()
        res["shutdown_s"] = time.monotonic() - t0
        d.cancel()
    deadline = time.monotonic() + 30
    while (left := [p for p in tree if alive(p)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    res["left"] = left
    return res


if __name__ == "__main__":
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout
    out = asyncio.run(main(sys.argv[1], sys.argv[2]))
    proto.write(json.dumps(out) + "\n")
