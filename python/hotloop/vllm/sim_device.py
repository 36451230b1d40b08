"""vLLM's CPU build with a simulated device: every step's host work is vLLM's own, the forward is a modelled
device time during which the worker's thread is off the CPU.

Contract:

- On only where ``HOTLOOP_VLLM_SIM_DEVICE`` is set (``1`` for the defaults, or ``BASE_US+PER_TOKEN_US``), in
  every process vLLM starts: the plugin's ``register()`` calls ``install()`` then, whether or not hotloop's queue
  is on (``HOTLOOP_VLLM``), so vLLM's own queue runs on the same device. Never on through the plugin alone.
  Benchmarks and tests set it; a user reproduces their figures with it.
- ``install()`` wraps ``CPUModelRunner.load_model``: after vLLM loads the model, the model's ``forward`` and
  ``compute_logits`` are replaced on that instance.
  - ``forward`` is the device (``hotloop.testing.device_clock``): a step of ``base + per_token x tokens``
    (tokens: the step's input ids, as vLLM scheduled them), queued behind the previous step, the TP ranks of a
    step ending together at the last rank's launch (or the previous step's end) + that time. It returns hidden
    states of the model's shape, zero but for the first two columns, which carry each token's id and position.
  - The path is vLLM's scheduling choice, as on a GPU (``sim_platform.py`` keeps vLLM's GPU default: async
    scheduling on with the multiprocess executor; ``--no-async-scheduling`` / ``async_scheduling=False`` turns
    it off). Synchronous: ``forward`` blocks until its step ends (``DeviceClock.step``). Async: ``forward``
    returns once the step is queued (``launch``); the sampled tokens' copy event (``AsyncGPUModelRunnerOutput``'s
    ``async_copy_ready_event``, which vLLM's ``WorkerAsyncOutputCopy`` thread waits on in ``get_output()``) and the
    runner's other events are :class:`StreamEvent`: ``synchronize()`` sleeps until the device ends the step that
    was last launched when the event was recorded, as a blocking CUDA event does.
  - ``compute_logits`` returns logits with one 1.0 per row, at ``(31 x id + 7 x position + 1) mod vocab``: greedy
    decoding is deterministic, differs between requests and positions (a mix-up shows), and is equal in every arm
    and at every TP size. Nothing of the real model runs: no matmul, no attention, no collective.
- vLLM's host work is all real: the scheduler, input preparation, the sampler, detokenizing, the executor's
  queues. Eager mode only (``enforce_eager=True``): a compiled graph would not call the replaced forward.
  Pipeline parallelism is refused (RuntimeError at load): a stage's output is not modelled.
- The ranks' clocks meet in ``/dev/shm/hotloop.devclock.<ident>-<instance>`` (the executor's distributed
  init ident, vLLM's instance id, or the engine core's pid where that is empty): one per engine, Ray's ranks on
  other simulated nodes of this machine included; removed once every rank has run a step.
- A rank waits for its peers' start of a step for ``HOTLOOP_VLLM_SIM_DEVICE_BARRIER_S`` (default 60 s), then
  raises, as a collective with a lost peer does after its own timeout (NCCL's: 10 min by default).
"""

from __future__ import annotations

import logging
import os

from hotloop.testing.device_clock import DeviceClock, parse_spec
from hotloop.vllm.class_patches import ClassPatches

ENV = "HOTLOOP_VLLM_SIM_DEVICE"
BARRIER_ENV = "HOTLOOP_VLLM_SIM_DEVICE_BARRIER_S"
log = logging.getLogger("vllm.hotloop")
_patches = ClassPatches()


def requested() -> tuple[float, float] | None:
    """(base_us, per_token_us) when HOTLOOP_VLLM_SIM_DEVICE asks for the simulated device, else None."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return None
    return parse_spec(value)


def _token_target(ids, positions, vocab: int):
    return (ids * 31 + positions * 7 + 1) % vocab


def attach(runner, base_us: float, per_token_us: float) -> DeviceClock:
    """Put `runner`'s loaded model on the simulated device; returns the rank's clock."""
    import torch
    from vllm.distributed import parallel_state

    if parallel_state.get_pp_group().world_size > 1:
        raise RuntimeError(f"{ENV}: pipeline parallelism is not modelled by the simulated device; use TP only")
    tp = parallel_state.get_tp_group()
    # one clock per engine, shared by its TP ranks: vLLM's instance id (the same in every rank, Ray's actors on
    # other simulated nodes included) or, where it is empty, the rendezvous port and the executor's pid
    ident = os.environ.get("VLLM_DIST_IDENT", "0").replace("/", "_")
    instance = getattr(runner.vllm_config, "instance_id", "") or str(os.getppid())
    clock = DeviceClock(f"{ident}-{instance}".replace("/", "_")[:80], tp.rank_in_group, tp.world_size, base_us,
                        per_token_us, float(os.environ.get(BARRIER_ENV, 60)))
    model = runner.model
    hidden_size = runner.model_config.get_hidden_size()
    vocab = runner.model_config.get_vocab_size()

    on_stream = bool(getattr(runner, "use_async_scheduling", False))
    if on_stream:
        _events_on(clock, runner)

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **_):
        n = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        if on_stream:
            clock.launch(n)  # queued on the device: the sampled tokens' event waits for it
        else:
            clock.step(n)
        hidden = torch.zeros((n, hidden_size), dtype=torch.float32)  # float32: ids stay exact
        if input_ids is not None:
            hidden[:, 0] = input_ids
        pos = positions if positions.dim() == 1 else positions[0]  # M-RoPE passes (3, n)
        hidden[:, 1] = pos[:n]
        return hidden

    def compute_logits(hidden_states):
        n = hidden_states.shape[0]
        ids = hidden_states[:, 0].to(torch.int64)
        pos = hidden_states[:, 1].to(torch.int64)
        logits = torch.zeros((n, vocab), dtype=torch.float32)
        logits[torch.arange(n), _token_target(ids, pos, vocab)] = 1.0
        return logits

    model.forward = forward  # nn.Module.__call__ calls the instance's forward
    model.compute_logits = compute_logits
    model._hotloop_device_clock = clock
    log.info("hotloop: simulated device in process %d (TP rank %d of %d): a step is %.0f us + %.1f us a token, "
             "off the CPU; %s", os.getpid(), tp.rank_in_group, tp.world_size, base_us, per_token_us,
             "async scheduling: forward queues, the output's event waits" if on_stream else
             "synchronous: forward blocks for the step")
    return clock


class StreamEvent:
    """torch.cuda.Event on the simulated device: a position on the rank's stream. ``record()`` marks the last
    step launched; ``synchronize()`` sleeps until the device has ended it (raising as the device does: a peer
    that never launched it); ``query()`` says whether it is known to have ended; ``wait()`` (a stream waiting on
    the event) orders nothing more than the device's one stream already does."""

    clock: DeviceClock | None = None  # the process's rank (one per vLLM worker process)

    def __init__(self, *args, **kwargs) -> None:
        self._step = 0

    def record(self, stream=None) -> None:
        self._step = self.clock.tail() if self.clock is not None else 0

    def synchronize(self) -> None:
        if self._step:
            self.clock.wait(self._step)

    def query(self) -> bool:
        return not self._step or self.clock.done(self._step)

    def wait(self, stream=None) -> None:
        pass


def _events_on(clock: DeviceClock, runner) -> None:
    """The async path's events wait on the device: vLLM's CPU worker made torch.cuda.Event / torch.Event no-op
    placeholders (vllm/v1/worker/cpu/shm.py); the simulated device's events stand in for them from here on in this
    worker process (the sampled tokens' copy event of every step, the input batch's), and for the one the runner
    already holds (its input-preparation event)."""
    import torch

    StreamEvent.clock = clock
    torch.cuda.Event = StreamEvent
    torch.Event = StreamEvent
    if getattr(runner, "prepare_inputs_event", None) is not None:
        runner.prepare_inputs_event = StreamEvent()


def install() -> bool:
    """Wrap vLLM's CPU model runner so its models load onto the simulated device (where HOTLOOP_VLLM_SIM_DEVICE asks
    for it). Returns whether it is installed. Idempotent."""
    spec = requested()
    if spec is None:
        return False
    if _patches:
        return True
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    real_load = CPUModelRunner.load_model

    def load_model(self, *args, **kwargs):
        real_load(self, *args, **kwargs)
        attach(self, *spec)

    _patches.set(CPUModelRunner, "load_model", load_model)
    return True


def uninstall() -> None:
    _patches.restore()


__all__ = ["ENV", "attach", "install", "requested", "uninstall"]
