"""The vLLM benchmarks: vLLM's own engine on its own queue against hotloop's, in the same run and process layout.

By what each module measures:

- ``offline``: ``hotloop bench vllm``: AsyncLLM in the driver's process (no server) through four load shapes, in
  three or four arms (vLLM's queue and loop, vLLM's spinloop extension, hotloop's queue, hotloop's queue and
  engine-core loop), on vLLM's CPU build or the simulated device; latency, throughput, CPU by process, idle CPU.
- ``online``: ``hotloop bench vllm --device sim --online``: the same shapes through ``vllm serve`` and ``vllm bench
  serve``, so the latency figures are vLLM's own.
- ``regimes``: ``hotloop bench vllm --device sim``: the offline (or online) run once per host regime: device-bound,
  a pod with a CPU quota (1.5 and 1 core), host-bound.
- ``batch``: the batch rows of ``hotloop bench vllm``: the offline ``LLM.generate`` API at batch 1 and 16 on vLLM's
  CPU build, vLLM's queue against hotloop's default wait (``python -m hotloop.bench.vllm.batch`` for A/B runs).
- ``broadcast``: the step broadcast's cost to its writer at TP=4 on two nodes, vLLM's MessageQueue against
  hotloop's (part of ``hotloop bench vllm-ray``).
- ``ray_executor`` (+ ``ray_driver``, the process on the head node): ``hotloop bench vllm-ray``: vLLM's Ray executor
  on two simulated nodes: outputs, the time from a cut to every request's error, a stranger on the queue ports.
- ``omni``: ``hotloop bench vllm-omni``: vllm-omni's two-stage text pipeline on vLLM's queue and on hotloop's.
- ``output_encode``: the engine core's output send against vLLM's output thread with small and large outputs
  (logprobs, pooling), device-bound and host-bound (``python -m hotloop.bench.vllm.output_encode``; no engine: the
  engine core's main thread, its output thread and a front-end process that decodes).

What they share, each in one place: ``arms`` (the arms and their environments, the load shapes, the checks that an
engine runs its arm, outputs compared across arms), ``processes`` (the CPU of a vLLM engine's processes and
threads, by kind and idle), ``driver`` (``Driver``: one offline ``LLM.generate`` engine in a process of its own, for
the batch rows and the vLLM tests). Imports go one way: ``offline`` imports ``online`` and ``batch``; they and
``omni`` import ``arms``, ``driver``, ``processes``, which import only ``hotloop.bench.proc`` and ``report``;
only ``regimes`` imports ``offline``.

Importing this package imports nothing: each module imports vLLM only inside the functions that run it.
"""
