"""The simulated device as Ray's device: vLLM's CPU platform with Ray's "GPU" resource key, so that vLLM's Ray
executor (``--distributed-executor-backend ray``) runs on vLLM's CPU build with the simulated device
(``sim_device.py``).

Contract:

- vLLM's CPU platform has no Ray device key: on the CPU build vLLM refuses the Ray executor ("current platform cpu
  does not support ray"). :class:`SimDevicePlatform` is that platform with ``ray_device_key = "GPU"``: each rank is
  a Ray actor holding one "GPU" of a placement group, as on a GPU cluster. The Ray nodes declare their simulated
  devices (``ray start --num-gpus=N``); nothing touches a real GPU (the worker is vLLM's CPU worker, its forward is
  the simulated device's).
- vLLM picks it through hotloop's ``vllm.platform_plugins`` entry point (``hotloop.vllm.platform_plugin``), in
  every process, Ray's actors included, only where ``HOTLOOP_VLLM_SIM_DEVICE`` is set and vLLM is the CPU build.
"""

from vllm.platforms.cpu import CpuPlatform


class SimDevicePlatform(CpuPlatform):
    """vLLM's CPU platform whose ranks are Ray actors, each holding one simulated device (Ray's "GPU")."""

    ray_device_key = "GPU"
