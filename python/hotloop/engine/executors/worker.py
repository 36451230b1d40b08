"""What a worker process (one tensor-parallel rank) runs, whoever placed it there: multiprocessing
(MultiprocExecutor) or a Ray actor.

``start_rank`` joins the ranks' torch.distributed group (gloo on CPU; NCCL when every rank has a GPU of its own)
and builds the rank's ModelRunner; ``serve_steps`` is the worker loop: dequeue each step from the broadcast
queue, run it, and on rank 0 (the output rank) answer its tokens on the response queue. On CUDA rank 0 waits for
its own step on its step notifier (GIL released) before it answers. The loop returns when the broadcast queue
shuts down or its writer dies; an exception in a step propagates (the caller exits, and the engine sees a dead
rank).
"""

from __future__ import annotations

import os

from hotloop._core import ClosedError, DeadPeerError
from hotloop.engine.model import ModelConfig
from hotloop.engine.model_runner import ModelRunner


def rank_device(device: str, rank: int) -> str:
    """The device of `rank`: "cuda" spreads ranks over the GPUs present (rank r on GPU r modulo their number)."""
    if device != "cuda":
        return device
    import torch

    return f"cuda:{rank % torch.cuda.device_count()}"


def rank_threads(world_size: int) -> int:
    """torch threads for one of `world_size` ranks sharing this node's CPUs: its share, at least one. torch's
    default (every CPU in every rank) oversubscribes the node: OpenMP threads that spin between parallel regions
    take the cores the other ranks compute on (measured on 2 CPUs, TP=2: 4 tok/s with the default, 352 with
    one thread per rank). $OMP_NUM_THREADS, when set, wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def start_rank(rank: int, world_size: int, config: ModelConfig, init_method: str, step_delay_s: float = 0.0,
               device: str = "cpu", backend: str | None = None) -> ModelRunner:
    """Join the ranks' process group at `init_method` (a torch.distributed URL, e.g. tcp://127.0.0.1:PORT; unused
    when world_size is 1) and build this rank's runner. `backend`: the torch.distributed backend when the caller
    knows it (a Ray rank sees only its own GPU); else NCCL when every rank gets a GPU of its own, gloo otherwise."""
    import torch

    torch.set_num_threads(rank_threads(world_size))
    own_gpus = device == "cuda"  # one GPU per rank when there are enough (NCCL cannot share one between ranks)
    device = rank_device(device, rank)
    all_reduce = None
    if world_size > 1:
        import torch
        import torch.distributed as dist

        own_gpus = own_gpus and torch.cuda.device_count() >= world_size
        backend = backend or ("nccl" if own_gpus else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        all_reduce = dist.all_reduce
    return ModelRunner(config, rank, world_size, all_reduce, step_delay_s, device)


def serve_steps(runner: ModelRunner, bcast, response=None) -> None:
    """Run every step `bcast` (this rank's reader of the broadcast MessageQueue) delivers; answer on `response`
    (rank 0's writer) when given. Returns when the broadcast queue shuts down or its writer dies."""
    while True:
        try:
            task = bcast.dequeue()
        except (ClosedError, DeadPeerError):
            return
        tokens = runner.execute(task)  # rank 0 on CUDA: waits on its step notifier (GIL released)
        if response is not None:
            response.enqueue(tokens)
