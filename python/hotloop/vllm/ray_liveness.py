"""vLLM's Ray executor (``RayExecutorV2``, ``--distributed-executor-backend ray``) watched by hotloop's liveness
links: a rank's node that stops answering fails the engine within the peer timeout, naming the rank and node.

Contract:

- What vLLM does alone: its monitor thread waits on each actor's ``run`` future, which Ray resolves only when the
  actor's process dies or when Ray's health checks give its node up (tens of seconds after a partition). Meanwhile
  rank 0 may sit in a collective with the lost rank (NCCL's own timeout is minutes) and the engine core waits for
  rank 0's answer, so requests hang.
- With hotloop's queue installed, each rank also holds one liveness link with the executor (hotloop's
  ``engine.executors.liveness``, the mechanism hotloop's own Ray executor uses: one TCP connection carrying
  heartbeats each way, the peer given up when nothing arrived from it for ``HOTLOOP_PEER_TIMEOUT_S``, default
  3 s). The rank opens its end on its Ray node address just before its ``run`` starts (a ``__ray_call__`` queued
  ahead of it on the actor).
- A link that times out or becomes unreachable fails the executor at once: it logs an error naming the rank, its
  Ray node id and address and what happened; marks the executor failed; ends the engine core's wait on every
  response queue with DeadPeerError carrying that text (``MessageQueue.fail``); kills every rank's actor; and
  calls vLLM's failure callback, so every request ends with vLLM's ``EngineDeadError``. vLLM's own shutdown
  then runs as after any failure. A rank's answers' own connection gives a cut-off node up after the same peer
  timeout as its link, in either order: the executor's readers of the answers wait up to REPORT_GRACE_S
  (hotloop's executors' grace, ``worker_group.py``) for the link's verdict before they raise their own
  (``report_grace_s``).
- A rank whose link to the executor ends (the executor's node is cut off, its process died, or it shut down)
  ends its own process at once, wherever its threads are blocked: nothing of the engine is left on a node the
  executor cannot reach.
- ``install()`` patches ``RayWorkerHandle.run``, ``RayExecutorV2._init_executor`` (a start that fails closes
  the links it opened), ``start_worker_monitor`` and ``shutdown`` where vLLM's Ray executor module is loaded
  (``uninstall()`` puts them back). The
  executor's process is the engine core's, which loads ``vllm.v1.executor.ray_executor_v2`` before the plugin
  when that executor is configured; hotloop's MessageQueue installs this too when the executor builds its queue.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading

from hotloop.vllm.class_patches import ClassPatches

MODULE = "vllm.v1.executor.ray_executor_v2"
LINK_TIMEOUT_S = 60.0  # how long a rank's end waits for the executor to connect
log = logging.getLogger("vllm.hotloop")
_patches = ClassPatches()
_lock = threading.Lock()
_starting: "_Links | None" = None  # the links of the executor whose ranks are being started in this process


def hold_engine_link(actor, token: bytes, timeout: float) -> tuple[str, int]:
    """On a rank's actor (``__ray_call__``): listen for the executor's link on this node's Ray address, hold it in
    a daemon thread, and end this process once it is lost. Returns (address, port)."""
    import ray

    from hotloop.engine.executors import liveness

    ip = ray.util.get_node_ip_address()
    listener = liveness.listen(ip)
    threading.Thread(target=liveness.hold, args=(listener, token, timeout, _exit_without_executor),
                     name="hotloop-liveness", daemon=True).start()
    return ip, listener.getsockname()[1]


def _exit_without_executor(why: str | None) -> None:
    log.error("hotloop: vLLM rank process %d lost its executor (%s); exiting", os.getpid(),
              why or "the executor closed its link")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


class _Links:
    """The liveness links of one RayExecutorV2, one per rank."""

    def __init__(self):
        from hotloop.engine.executors import liveness  # (hotloop.engine needs torch, which vLLM brings)

        self.watcher = liveness.LinkWatcher(self._lost)
        self.where: dict[int, str] = {}
        self.executor = None
        self.failed = False

    def add(self, handle) -> None:
        """Open rank ``handle.rank``'s link (before its ``run`` is queued on the actor)."""
        import ray

        token = secrets.token_bytes(16)
        ip, port = ray.get(handle.actor.__ray_call__.remote(hold_engine_link, token, LINK_TIMEOUT_S),
                           timeout=LINK_TIMEOUT_S)
        self.watcher.connect(handle.rank, ip, port, token, LINK_TIMEOUT_S)
        self.where[handle.rank] = f"Ray node {handle.node_id} at {ip}"

    def start(self, executor) -> None:
        from hotloop.engine.executors.worker_group import REPORT_GRACE_S

        self.executor = executor
        for mq in getattr(executor, "response_mqs", []):
            if hasattr(mq, "report_grace_s"):  # hotloop's queue (vLLM's own has no such wait)
                mq.report_grace_s = REPORT_GRACE_S
        self.watcher.start()
        from hotloop.queue.remote import peer_timeout_s

        log.info("hotloop: vLLM's Ray executor holds a liveness link with each of its %d ranks (peer timeout %d s, "
                 "HOTLOOP_PEER_TIMEOUT_S) in process %d", len(self.where), peer_timeout_s(), os.getpid())

    def _lost(self, rank: int, why: str) -> None:
        import ray

        ex = self.executor
        if ex is None or getattr(ex, "shutting_down", False) or self.failed:
            return  # the first rank lost names the failure; the rest of its node follows it
        self.failed = True
        reason = f"rank {rank} ({self.where.get(rank, 'unknown node')}): {why}; vLLM's engine cannot run more steps"
        log.error("hotloop: %s", reason)
        ex.is_failed = True
        for mq in list(getattr(ex, "response_mqs", [])):  # the engine core's wait for the step's answer ends now
            fail = getattr(mq, "fail", None)
            if fail is not None:
                fail(reason)
        for h in list(getattr(ex, "ray_worker_handles", [])):  # a rank may be blocked in a collective with it
            try:
                ray.kill(h.actor)
            except Exception as e:  # noqa: BLE001  (an actor already gone; logged)
                log.warning("hotloop: could not kill rank %d's actor: %s", h.rank, e)
        callback, ex.failure_callback = ex.failure_callback, None
        if callback is not None:
            callback()

    def close(self) -> None:
        self.watcher.close()


def _init_executor(original):
    def init_executor(executor):
        global _starting
        with _lock:
            stale, _starting = _starting, None  # an earlier executor's start that failed half-way
        if stale is not None:
            stale.close()
        try:
            original(executor)
        except BaseException:
            with _lock:
                links, _starting = _starting, None
            if links is not None:
                links.close()  # the ranks that were linked exit; vLLM's own clean-up kills the rest
            raise

    return init_executor


def _run(original):
    def run(handle):
        global _starting
        with _lock:
            if _starting is None:
                _starting = _Links()
            links = _starting
        links.add(handle)
        original(handle)

    return run


def _start_worker_monitor(original):
    def start_worker_monitor(executor, *args, **kwargs):
        global _starting
        with _lock:
            links, _starting = _starting, None
        if links is not None:
            executor._hotloop_links = links
            links.start(executor)
        original(executor, *args, **kwargs)

    return start_worker_monitor


def _shutdown(original):
    def shutdown(executor):
        try:
            original(executor)
        finally:
            links = executor.__dict__.pop("_hotloop_links", None)
            if links is not None:
                links.close()  # a rank still running (cut off) exits once it sees its link lost

    return shutdown


def install() -> bool:
    """Patch vLLM's Ray executor in this process if its module is loaded; returns whether it is patched."""
    mod = sys.modules.get(MODULE)
    if mod is None or getattr(mod, "ray", None) is None:
        return False
    with _lock:
        if _patches:
            return True
        _patches.set(mod.RayExecutorV2, "_init_executor", _init_executor(mod.RayExecutorV2._init_executor))
        _patches.set(mod.RayWorkerHandle, "run", _run(mod.RayWorkerHandle.run))
        _patches.set(mod.RayExecutorV2, "start_worker_monitor", _start_worker_monitor(mod.RayExecutorV2.start_worker_monitor))
        _patches.set(mod.RayExecutorV2, "shutdown", _shutdown(mod.RayExecutorV2.shutdown))
    log.debug("hotloop: vLLM's Ray executor patched for liveness links in process %d", os.getpid())
    return True


def uninstall() -> None:
    global _starting
    with _lock:
        _patches.restore()
        _starting = None


__all__ = ["LINK_TIMEOUT_S", "hold_engine_link", "install", "uninstall"]
