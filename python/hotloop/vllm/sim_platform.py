"""The simulated device's platform: vLLM's CPU platform with a GPU's scheduling default and Ray's "GPU" resource
key, so that vLLM runs its GPU path, and its Ray executor (``--distributed-executor-backend ray``), on vLLM's CPU
build with the simulated device (``sim_device.py``).

Contract:

- vLLM's CPU platform has no Ray device key: on the CPU build vLLM refuses the Ray executor ("current platform cpu
  does not support ray"). :class:`SimDevicePlatform` is that platform with ``ray_device_key = "GPU"``: each rank is
  a Ray actor holding one "GPU" of a placement group, as on a GPU cluster. The Ray nodes declare their simulated
  devices (``ray start --num-gpus=N``); nothing touches a real GPU (the worker is vLLM's CPU worker, its forward is
  the simulated device's).
- Scheduling is the GPU's: vLLM resolves ``async_scheduling`` before the platform's hook (on by default with the
  multiprocess and Ray executors, off with ``--no-async-scheduling`` or an incompatible option); the CPU platform's
  hook turns it off ("not required on CPU"), this one keeps what vLLM resolved, so the simulated device runs the
  path GPU users run (``sim_device.py``: forward queues the step, the output's event waits for the device).
- vLLM picks it through hotloop's ``vllm.platform_plugins`` entry point (``hotloop.vllm.platform_plugin``), in
  every process, Ray's actors included, only where ``HOTLOOP_VLLM_SIM_DEVICE`` is set and vLLM is the CPU build.
"""

from vllm.platforms.cpu import CpuPlatform


class SimDevicePlatform(CpuPlatform):
    """vLLM's CPU platform whose ranks are Ray actors, each holding one simulated device (Ray's "GPU")."""

    ray_device_key = "GPU"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        # vLLM resolved async scheduling before this hook as on a GPU (on unless turned off or incompatible);
        # the CPU platform turns it off: keep the GPU's choice, the simulated device runs that path.
        sched = vllm_config.scheduler_config
        wanted = sched.async_scheduling
        super().check_and_update_config(vllm_config)
        if wanted:
            sched.async_scheduling = True
