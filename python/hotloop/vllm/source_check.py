"""Does a vLLM release call only what hotloop.vllm provides? Read from its source, without running vLLM.

Contract:

- ``check(source)`` reads a vLLM source tree (an installed ``vllm`` package directory, or a vLLM wheel: the CUDA
  build ``vllm`` can be checked on a machine without a GPU) and returns one :class:`Finding` per requirement
  hotloop.vllm has of it; ``ok`` False means the plugin or the engine-core loop would break on that release
  (the finding says where and why). Nothing of it is imported or executed: it is parsed (``ast``).
- What it checks: every method of vLLM's ``MessageQueue`` that vLLM calls is on
  :class:`hotloop.vllm.MessageQueue` and accepts the same arguments (by position and name), and what ours leaves
  out is used nowhere outside vLLM's own queue module; the constructor and static calls made by name
  (``MessageQueue(...)``, ``MessageQueue.create_from_process_group(...)``) pass only keywords ours takes; the
  handle fields vLLM reads outside the queue module are fields ours has; the plugin loader reads the
  ``vllm.general_plugins`` entry points; what ``engine_loop`` hooks (``FutureWrapper.result`` and its
  ``get_response`` closure over ``response_mqs`` and ``deadline``, ``EngineCoreProc``'s ``input_queue``,
  ``_process_engine_step``, ``_handle_client_request``), what ``output_send`` mirrors (``EngineCoreProc``'s
  ``output_queue`` and its ``process_output_sockets`` thread: one of the bodies in ``output_send.MIRRORED``, and
  only ``put_nowait`` / ``put`` / ``get`` used of the queue), what ``input_read`` mirrors (``process_input_sockets``
  one of the bodies in ``input_read.MIRRORED``, started as the input thread, the names it takes from the module,
  and only the ``queue.Queue`` methods ``EngineInputQueue`` has used of ``input_queue``), what ``timeline`` stamps,
  and what ``ray_liveness`` relies on in vLLM's Ray executor (``RayWorkerHandle.run`` and its fields, every rank
  run before the monitor starts, the executor's ``response_mqs``, ``ray_worker_handles``, ``is_failed``,
  ``failure_callback``) are there; and the output classes ``device_wait`` wraps, of both GPU model runners
  (``device_wait.RUNNERS``: V1's ``AsyncGPUModelRunnerOutput`` and its pooling twin, V2's ``AsyncOutput`` and
  ``AsyncPoolingOutput``), each with an ``__init__`` taking the copy stream by its name that records the event
  attribute, and a ``get_output()`` that synchronizes it.
- ``python -m hotloop.vllm.source_check [PATH_OR_WHEEL ...]`` prints the findings (default: the installed vLLM)
  and exits 1 when one fails: run it on a new vLLM release before adding it to ``SUPPORTED_VLLM_VERSIONS``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import zipfile
from collections.abc import Iterator

QUEUE_MODULE = "vllm/distributed/device_communicators/shm_broadcast.py"
EXECUTOR_MODULE = "vllm/v1/executor/multiproc_executor.py"
ENGINE_CORE_MODULE = "vllm/v1/engine/core.py"
PLUGINS_MODULE = "vllm/plugins/__init__.py"
RAY_EXECUTOR_MODULE = "vllm/v1/executor/ray_executor_v2.py"

# vLLM's queue methods hotloop's class leaves out on purpose: its writer and reader internals (hotloop's are C++).
# The check fails if vLLM calls one of them outside its own queue module.
NOT_PROVIDED = {
    "acquire_write": "vLLM's writer internals (hotloop's writer is C++)",
    "recv": "a static helper over vLLM's own ZeroMQ socket",
}
# The Handle fields hotloop's handle has (vLLM's executor reads these two of its own Handle's).
HANDLE_FIELDS = ("local_reader_ranks", "remote_subscribe_addr")
# What timeline.py wraps: (module, class, method).
TIMELINE_HOOKS = (
    ("vllm/v1/engine/core.py", "EngineCore", "preprocess_add_request"),
    ("vllm/v1/engine/core.py", "EngineCore", "add_request"),
    ("vllm/v1/engine/core_client.py", "AsyncMPClient", "add_request_async"),
    (EXECUTOR_MODULE, "MultiprocExecutor", "execute_model"),
    (EXECUTOR_MODULE, "MultiprocExecutor", "sample_tokens"),
    ("vllm/v1/core/sched/scheduler.py", "Scheduler", "update_from_output"),
    ("vllm/v1/worker/worker_base.py", "WorkerWrapperBase", "execute_model"),
)


@dataclasses.dataclass
class Finding:
    what: str  # the requirement
    ok: bool
    detail: str = ""  # where, or why not

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what}{': ' + self.detail if self.detail else ''}"


class VllmSource:
    """The ``vllm/**.py`` files of an installed package directory (the one holding ``vllm/``, or ``vllm/``
    itself) or of a wheel."""

    def __init__(self, path: str):
        self.path = path
        self._files: dict[str, str] = {}
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as wheel:
                for name in wheel.namelist():
                    if name.startswith("vllm/") and name.endswith(".py"):
                        self._files[name] = wheel.read(name).decode("utf-8", "replace")
        else:
            path = path.rstrip("/")
            root = os.path.dirname(path) if os.path.basename(path) == "vllm" else path
            for dirpath, _, names in os.walk(os.path.join(root, "vllm")):
                for name in names:
                    if name.endswith(".py"):
                        full = os.path.join(dirpath, name)
                        with open(full, encoding="utf-8", errors="replace") as f:
                            self._files[os.path.relpath(full, root).replace(os.sep, "/")] = f.read()
        if QUEUE_MODULE not in self._files:
            raise ValueError(f"{path}: no {QUEUE_MODULE} there; give a vLLM wheel or the directory holding vllm/")
        self._trees: dict[str, ast.Module] = {}
        self._attributes: dict[str, set[str]] = {}

    def files(self) -> Iterator[tuple[str, str]]:
        return iter(sorted(self._files.items()))

    def text(self, rel: str) -> str:
        return self._files.get(rel, "")

    def attributes(self, rel: str) -> set[str]:
        """Every attribute name read in ``rel`` (``x.name``), found once per file."""
        if rel not in self._attributes:
            self._attributes[rel] = {n.attr for n in ast.walk(self.tree(rel)) if isinstance(n, ast.Attribute)}
        return self._attributes[rel]

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._files:
            return None
        if rel not in self._trees:
            self._trees[rel] = ast.parse(self._files[rel], rel)
        return self._trees[rel]

    def version(self) -> str:
        for rel in ("vllm/_version.py", "vllm/version.py"):
            for node in ast.walk(self.tree(rel) or ast.Module(body=[], type_ignores=[])):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                        isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                    return str(node.value.value)
        return "unknown"


def _class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    for node in (tree.body if tree else ()):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_static(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _vllm_params(fn: ast.FunctionDef) -> list[str]:
    """vLLM's parameters in order, without self / cls."""
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return names if _is_static(fn) or not names else names[1:]


def _accepts(ours, theirs: list[str], by_position: bool = True) -> str:
    """'' when our callable takes each of vLLM's parameters by name (and, ``by_position``, at the same position);
    else why not."""
    try:
        sig = inspect.signature(ours)
    except (TypeError, ValueError) as e:
        return f"its signature cannot be read ({e})"
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    if any(p.kind is p.VAR_POSITIONAL for p in params) and any(p.kind is p.VAR_KEYWORD for p in params):
        return ""
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for i, name in enumerate(theirs):
        if by_position and i < len(positional) and positional[i] != name and name not in named:
            return f"vLLM's parameter {i + 1} is {name!r}, ours is {positional[i]!r}"
        if name not in named and not any(p.kind is p.VAR_KEYWORD for p in params):
            return f"ours does not take {name!r} ({sig})"
    return ""


def _outside_uses(source: VllmSource, attr: str, skip: str = QUEUE_MODULE) -> list[str]:
    """Files (other than ``skip``) that read ``.attr``."""
    where = []
    for rel, text in source.files():
        if rel != skip and f".{attr}" in text and attr in source.attributes(rel):
            where.append(rel)
    return where


def _queue_checks(source: VllmSource, ours) -> list[Finding]:
    out = []
    cls = _class(source.tree(QUEUE_MODULE), "MessageQueue")
    if cls is None:
        return [Finding("vLLM's MessageQueue class", False, f"not found in {QUEUE_MODULE}")]
    for name, fn in _methods(cls).items():
        if name.startswith("__") and name != "__init__":
            continue
        if name.startswith("_") and name != "__init__":
            used = _outside_uses(source, name)
            out.append(Finding(f"vLLM's private MessageQueue.{name} is used only by its own class", not used,
                               f"also read in {', '.join(used)}" if used else ""))
            continue
        if name in NOT_PROVIDED:
            used = [] if name == "recv" else _outside_uses(source, name)
            out.append(Finding(f"MessageQueue.{name} left out ({NOT_PROVIDED[name]}) and not called outside the "
                               "queue module", not used, f"called in {', '.join(used)}" if used else ""))
            continue
        mine = getattr(ours, name, None)
        if mine is None:
            out.append(Finding(f"MessageQueue.{name}", False, "vLLM's class has it, hotloop's does not"))
            continue
        why = _accepts(mine, _vllm_params(fn))
        out.append(Finding(f"MessageQueue.{name}({', '.join(_vllm_params(fn))})", not why, why))
    # calls by the class's name: its keywords must be ones ours takes
    for rel, text in source.files():
        if "MessageQueue" not in text or rel == QUEUE_MODULE:
            continue
        for node in ast.walk(source.tree(rel)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "MessageQueue":
                target, label = ours, "MessageQueue(...)"
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "MessageQueue":
                target, label = getattr(ours, f.attr, None), f"MessageQueue.{f.attr}(...)"
                if target is None:
                    out.append(Finding(f"{label} in {rel}:{node.lineno}", False, "hotloop's class has no such call"))
                    continue
            else:
                continue
            keywords = [k.arg for k in node.keywords if k.arg]
            why = _accepts(target, keywords, by_position=False) if keywords else ""
            out.append(Finding(f"{label} in {rel}:{node.lineno} with keywords {keywords}", not why, why))
    handle = _class(source.tree(QUEUE_MODULE), "Handle")
    fields = [n.target.id for n in (handle.body if handle else ()) if isinstance(n, ast.AnnAssign)]
    for field in fields:
        used = _outside_uses(source, field)
        if used:
            out.append(Finding(f"Handle.{field} read outside the queue module is on hotloop's handle",
                               field in HANDLE_FIELDS, f"read in {', '.join(used)}"))
    return out


def _has_method(source: VllmSource, rel: str, cls_name: str, method: str) -> Finding:
    cls = _class(source.tree(rel), cls_name)
    ok = cls is not None and method in _methods(cls)
    return Finding(f"{cls_name}.{method} ({rel})", ok, "" if ok else "not there")


def _loop_checks(source: VllmSource) -> list[Finding]:
    out = [_has_method(source, EXECUTOR_MODULE, "FutureWrapper", "result")]
    executor = _class(source.tree(EXECUTOR_MODULE), "MultiprocExecutor")
    rpc = _methods(executor).get("collective_rpc") if executor else None
    inner = next((n for n in ast.walk(rpc) if isinstance(n, ast.FunctionDef) and n.name == "get_response"), None) \
        if rpc else None
    names = {n.id for n in ast.walk(inner) if isinstance(n, ast.Name)} if inner else set()
    missing = {"response_mqs", "deadline"} - names
    out.append(Finding("collective_rpc's get_response closes over response_mqs and deadline (engine_loop reads "
                       "them)", inner is not None and not missing,
                       "no get_response in collective_rpc" if inner is None else
                       (f"it does not read {sorted(missing)}" if missing else "")))
    for method in ("_process_engine_step", "_handle_client_request", "__init__"):
        out.append(_has_method(source, ENGINE_CORE_MODULE, "EngineCoreProc", method))
    proc = _class(source.tree(ENGINE_CORE_MODULE), "EngineCoreProc")
    out.append(_init_assigns(proc, "input_queue", "engine_loop"))
    return out


def _init_assigns(proc: ast.ClassDef | None, attr: str, user: str) -> Finding:
    """Whether EngineCoreProc.__init__ assigns ``self.<attr>`` (the queue `user` converts on its first read)."""
    init = _methods(proc).get("__init__") if proc else None
    assigns = init is not None and any(
        isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Attribute) and t.attr == attr
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
        for n in ast.walk(init))
    return Finding(f"EngineCoreProc.__init__ assigns self.{attr} ({user} converts it on first read)", assigns,
                   "" if assigns else "not assigned there")


def _starts_thread_on(methods: dict[str, ast.FunctionDef], kind: str, method: str) -> Finding:
    """Whether EngineCoreProc.__init__ (in `methods`) starts a thread with ``target=self.<method>``, looked up on the
    instance after the plugin has patched the class."""
    init = methods.get("__init__")
    target = init is not None and any(
        isinstance(n, ast.keyword) and n.arg == "target" and isinstance(n.value, ast.Attribute)
        and n.value.attr == method for n in ast.walk(init))
    return Finding(f"EngineCoreProc.__init__ starts its {kind} thread on self.{method} (looked up after the plugin "
                   "loads)", target, "" if target else "no such thread target")


def _mirrors(fn: ast.FunctionDef | None, what: str, user: str, mirrored: dict[str, str], against: str,
             detail: str = "") -> Finding:
    """Whether vLLM's function `fn` is one of the bodies `user` copies (`mirrored`: digest -> releases); where not,
    its digest, `detail`, and what to read it against before adding it."""
    from hotloop.vllm.mirrored import tree_digest

    digest = tree_digest(fn) if fn else None
    ok = digest in mirrored
    return Finding(f"{what} is a body {user} mirrors (vLLM {mirrored.get(digest, '?')})", ok,
                   "" if ok else "not there" if fn is None else
                   f"digest {digest}{detail}: read it against {against}, then add it to {user}.MIRRORED")


def _uses_only(source: VllmSource, attr: str, allowed: tuple[str, ...], what: str) -> Finding:
    """Whether vLLM's modules use nothing of ``<anything>.<attr>`` but `allowed`, methods called and attributes read
    alike (``.mutex``, ``.queue``); where they do, each other name with the files that use it."""
    uses: dict[str, set[str]] = {}
    for rel, text in source.files():
        if attr in text:
            for n in ast.walk(source.tree(rel)):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == attr:
                    uses.setdefault(n.attr, set()).add(rel)
    other = {m: sorted(f) for m, f in uses.items() if m not in allowed}
    return Finding(f"vLLM uses only {what} of an {attr}", not other, f"also {other}" if other else "")


def _output_send_checks(source: VllmSource) -> list[Finding]:
    """What output_send.py mirrors and relies on in vLLM's engine core."""
    from hotloop.vllm import output_send

    tree = source.tree(ENGINE_CORE_MODULE)
    proc = _class(tree, "EngineCoreProc")
    methods = _methods(proc) if proc else {}
    out = [_init_assigns(proc, "output_queue", "output_send"),
           _starts_thread_on(methods, "output", "process_output_sockets")]
    fn = methods.get("process_output_sockets")
    args = [a.arg for a in fn.args.args] if fn else []
    names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(fn)
             if isinstance(n, (ast.Attribute, ast.Name))} if fn else set()
    needed = {"make_zmq_socket", "PUSH", "MsgpackEncoder", "encode_into", "encode", "ENGINE_CORE_DEAD",
              "_send_msg_tracking_payload"}
    shape = args == ["self", "output_paths", "coord_output_path", "engine_index"] and needed <= names
    out.append(_mirrors(fn, "EngineCoreProc.process_output_sockets(output_paths, coord_output_path, engine_index)",
                        "output_send", output_send.MIRRORED, "output_send.process_output_sockets",
                        "" if shape else f"; arguments {args}" if needed <= names else
                        f"; arguments {args}; does not use {sorted(needed - names)}"))
    imported = {a.asname or a.name for n in (tree.body if tree else ()) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    missing = {"make_zmq_socket", "MsgpackEncoder"} - imported
    out.append(Finding("vllm.v1.engine.core imports make_zmq_socket and MsgpackEncoder by name (output_send takes "
                       "them from it)", not missing, f"missing {sorted(missing)}" if missing else ""))
    # every module: the fault-tolerance sentinel puts into it too
    out.append(_uses_only(source, "output_queue", ("put_nowait", "put", "get"), "put_nowait, put and get"))
    return out


def _input_read_checks(source: VllmSource) -> list[Finding]:
    """What input_read.py mirrors and relies on in vLLM's engine core."""
    from hotloop.vllm import input_read

    tree = source.tree(ENGINE_CORE_MODULE)
    proc = _class(tree, "EngineCoreProc")
    methods = _methods(proc) if proc else {}
    out = [_starts_thread_on(methods, "input", "process_input_sockets"),
           _mirrors(methods.get("process_input_sockets"), "EngineCoreProc.process_input_sockets", "input_read",
                    input_read.MIRRORED, "input_read.InputReader.decode and the handshake")]
    defined = {a.asname or a.name for n in (tree.body if tree else ()) if isinstance(n, ast.ImportFrom)
               for a in n.names}
    defined |= {t.id for n in (tree.body if tree else ()) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    needed = {"make_zmq_socket", "MsgpackDecoder", "EngineCoreRequest", "EngineCoreRequestType",
              "MultiModalCacheMissError", "FT_UTILITY_METHOD"}
    missing = needed - defined
    out.append(Finding("vllm.v1.engine.core has make_zmq_socket, MsgpackDecoder, EngineCoreRequest(Type), "
                       "MultiModalCacheMissError and FT_UTILITY_METHOD by name (input_read takes them from it)",
                       not missing, f"missing {sorted(missing)}" if missing else ""))
    out.append(_uses_only(source, "input_queue", ("put_nowait", "put", "get", "get_nowait", "empty", "qsize"),
                          "the queue.Queue methods EngineInputQueue has"))
    return out


def _ray_checks(source: VllmSource) -> list[Finding]:
    """What ray_liveness.py relies on in vLLM's Ray executor (a release without that executor: nothing to patch)."""
    if source.tree(RAY_EXECUTOR_MODULE) is None:
        return [Finding(f"vLLM's Ray executor ({RAY_EXECUTOR_MODULE})", True, "not in this release: nothing to patch")]
    out = [_has_method(source, RAY_EXECUTOR_MODULE, "RayWorkerHandle", "run")]
    out += [_has_method(source, RAY_EXECUTOR_MODULE, "RayExecutorV2", m) for m in ("start_worker_monitor", "shutdown")]
    handle = _class(source.tree(RAY_EXECUTOR_MODULE), "RayWorkerHandle")
    fields = {n.target.id for n in (handle.body if handle else []) if isinstance(n, ast.AnnAssign)
              and isinstance(n.target, ast.Name)}
    missing = {"actor", "rank", "node_id"} - fields
    out.append(Finding("RayWorkerHandle has actor, rank and node_id", handle is not None and not missing,
                       f"missing {sorted(missing)}" if missing else ""))
    executor = _class(source.tree(RAY_EXECUTOR_MODULE), "RayExecutorV2")
    init = _methods(executor).get("_init_executor") if executor else None
    text = ast.get_source_segment(source.text(RAY_EXECUTOR_MODULE), init) or "" if init else ""
    runs, monitor = text.find("handle.run()"), text.find("self.start_worker_monitor(")
    out.append(Finding("RayExecutorV2._init_executor runs every handle, then starts its monitor (the links are "
                       "opened in between)", 0 <= runs < monitor, "" if 0 <= runs < monitor else "order changed"))
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute)} if init else set()
    missing = {"response_mqs", "ray_worker_handles", "is_failed", "failure_callback"} - assigned
    out.append(Finding("RayExecutorV2._init_executor sets response_mqs, ray_worker_handles, is_failed and "
                       "failure_callback", init is not None and not missing,
                       f"not set there: {sorted(missing)}" if missing else ""))
    return out


def _self_attr_call(fn: ast.FunctionDef, attr: str, method: str) -> bool:
    """Whether ``fn`` calls ``self.<attr>.<method>(...)``."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method
               and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == attr
               and isinstance(n.func.value.value, ast.Name) and n.func.value.value.id == "self"
               for n in ast.walk(fn))


def _device_wait_checks(source: VllmSource) -> list[Finding]:
    """What device_wait.py wraps in each of vLLM's GPU model runners (its RUNNERS)."""
    from hotloop.vllm.device_wait import RUNNERS

    out = []
    for runner in RUNNERS:
        rel = runner.module.replace(".", "/") + ".py"
        for name in runner.classes:
            what = (f"Model Runner {runner.name}'s {name}.__init__ takes {runner.stream} and records "
                    f"self.{runner.event}, get_output() synchronizes it ({rel}; device_wait wraps it)")
            cls = _class(source.tree(rel), name)
            methods = _methods(cls) if cls else {}
            init, get = methods.get("__init__"), methods.get("get_output")
            if init is None or get is None:
                gone = "the class" if cls is None else "__init__" if init is None else "get_output()"
                out.append(Finding(what, False, f"{gone} is not there"))
                continue
            missing = []
            if runner.stream not in _vllm_params(init):
                missing.append(f"no {runner.stream} parameter ({', '.join(_vllm_params(init))})")
            if not _self_attr_call(init, runner.event, "record"):
                missing.append(f"__init__ does not call self.{runner.event}.record()")
            if not _self_attr_call(get, runner.event, "synchronize"):
                missing.append(f"get_output() does not call self.{runner.event}.synchronize()")
            out.append(Finding(what, not missing, "; ".join(missing)))
    return out


def check(path: str) -> tuple[str, list[Finding]]:
    """vLLM's version at ``path`` and the findings (see the module's contract)."""
    from hotloop.vllm.message_queue import MessageQueue

    source = VllmSource(path)
    findings = _queue_checks(source, MessageQueue)
    plugins = source.text(PLUGINS_MODULE)
    ok = "vllm.general_plugins" in plugins and "def load_general_plugins" in plugins
    findings.append(Finding("the plugin loader reads the vllm.general_plugins entry points", ok,
                            "" if ok else f"not in {PLUGINS_MODULE}"))
    findings += _loop_checks(source)
    findings += _output_send_checks(source)
    findings += _input_read_checks(source)
    findings += _ray_checks(source)
    findings += [_has_method(source, *hook) for hook in TIMELINE_HOOKS]
    findings += _device_wait_checks(source)
    return source.version(), findings


def _installed() -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here; give a vLLM wheel or source directory")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def main(argv: list[str] | None = None) -> int:
    paths = (sys.argv[1:] if argv is None else argv) or [_installed()]
    failed = 0
    for path in paths:
        version, findings = check(path)
        bad = [f for f in findings if not f.ok]
        failed += len(bad)
        print(f"vLLM {version} ({path}): {len(findings) - len(bad)} of {len(findings)} requirements hold")
        for f in findings:
            print("  ", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
