"""hotloop.vllm.source_check: the calls a vLLM release makes, read from its source, against what hotloop.vllm
provides. Runs on the installed vLLM and on the vLLM wheels in HOTLOOP_VLLM_WHEELS (CI downloads the CUDA build
0.33.0 there: its engine cannot run without a GPU, its source can be read), and on a small synthetic source tree
that each failure is put into, to show the check catches it."""

import ast
import glob
import os
import textwrap

import pytest

from hotloop.vllm import input_read, is_supported, mirrored, output_send, source_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.environ.get("HOTLOOP_VLLM_WHEELS", os.path.join(ROOT, "build", "vllm-wheels"))


def _failed(findings):
    return [str(f) for f in findings if not f.ok]


def test_installed_vllm_calls_only_what_hotloop_provides():
    try:
        path = source_check._installed()
    except SystemExit:
        pytest.skip("vLLM is not installed here")
    version, findings = source_check.check(path)
    assert is_supported(version), version
    assert len(findings) > 30 and not _failed(findings)


@pytest.mark.parametrize("wheel", sorted(glob.glob(os.path.join(WHEELS, "vllm-*.whl"))) or [None])
def test_vllm_wheel_calls_only_what_hotloop_provides(wheel):
    if wheel is None:
        pytest.skip(f"no vLLM wheel in {WHEELS} (pip download --no-deps vllm==0.33.0 -d {WHEELS}; "
                    "scripts/test.sh does)")
    version, findings = source_check.check(wheel)
    assert is_supported(version), f"{wheel} is vLLM {version}, not a supported release"
    assert len(findings) > 30 and not _failed(findings)


# A vLLM as small as the check's requirements: each test below breaks one thing in it.
TREE = {
    "vllm/_version.py": "__version__ = version = '0.33.0'\n",
    "vllm/plugins/__init__.py": """
        DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
        def load_general_plugins(): pass
    """,
    "vllm/distributed/device_communicators/shm_broadcast.py": """
        class Handle:
            local_reader_ranks: list
            buffer_handle: tuple
            remote_subscribe_addr: str
        class MessageQueue:
            def __init__(self, n_reader, n_local_reader, local_reader_ranks=None, max_chunk_bytes=1,
                         max_chunks=1, connect_ip=None): pass
            def export_handle(self): pass
            @staticmethod
            def create_from_handle(handle, rank): pass
            def enqueue(self, obj, timeout=None): pass
            def dequeue(self, timeout=None, indefinite=False): pass
            def acquire_write(self, timeout=None): pass
            def _wait_until_readable(self, metadata_buffer, read_timeout): pass
    """,
    "vllm/v1/executor/multiproc_executor.py": """
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        class FutureWrapper:
            def result(self, timeout=None): pass
        class MultiprocExecutor:
            def _init_executor(self):
                self.rpc_broadcast_mq = MessageQueue(2, 2, max_chunk_bytes=10)
                handle = self.rpc_broadcast_mq.export_handle()
                ranks = handle.local_reader_ranks
            def collective_rpc(self, method, timeout=None):
                deadline = timeout
                response_mqs = self.response_mqs
                def get_response():
                    return [mq.dequeue(timeout=deadline) for mq in response_mqs]
                return FutureWrapper()
            def execute_model(self, scheduler_output): pass
            def sample_tokens(self, grammar_output): pass
    """,
    "vllm/v1/engine/core.py": """
        import queue
        import threading
        import zmq
        from vllm.utils.network_utils import make_zmq_socket
        from vllm.v1.serial_utils import MsgpackEncoder
        from vllm.v1.serial_utils import MsgpackDecoder
        from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
        from vllm.multimodal.cache import MultiModalCacheMissError
        FT_UTILITY_METHOD = "ft_command"
        class EngineCore:
            def preprocess_add_request(self, request): pass
            def add_request(self, request): pass
        class EngineCoreProc(EngineCore):
            ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
            def __init__(self):
                self.input_queue = queue.Queue()
                self.output_queue = queue.Queue()
                self.output_thread = threading.Thread(target=self.process_output_sockets, args=([], None, 0))
                threading.Thread(target=self.process_input_sockets, args=([], None, b"", None)).start()
                self.input_queue.get(block=True)
            def _process_engine_step(self):
                self.output_queue.put_nowait((0, None))
            def _handle_client_request(self, request_type, request): pass
            def process_input_sockets(self, input_addresses, coord_input_address, identity, ready_event):
                decoder = MsgpackDecoder(EngineCoreRequest)
                self.input_queue.put_nowait((EngineCoreRequestType.ADD, decoder.decode([])))
            def process_output_sockets(self, output_paths, coord_output_path, engine_index):
                encoder = MsgpackEncoder()
                sockets = [make_zmq_socket(None, p, zmq.PUSH, linger=4000) for p in output_paths]
                while True:
                    output = self.output_queue.get()
                    if output == EngineCoreProc.ENGINE_CORE_DEAD:
                        break
                    if output[0] == -1:
                        encoder.encode(output[1])
                    self._send_msg_tracking_payload(sockets[0], encoder.encode_into(output[1], bytearray()))
    """,
    "vllm/v1/executor/ray_executor_v2.py": """
        class RayWorkerHandle:
            actor: object
            rank: int
            local_rank: int
            node_id: str
            def run(self): pass
        class RayExecutorV2:
            def _init_executor(self):
                self.is_failed = False
                self.failure_callback = None
                self.ray_worker_handles = []
                self.response_mqs = []
                for handle in self.ray_worker_handles:
                    handle.run()
                self.start_worker_monitor()
            def start_worker_monitor(self, inline=False): pass
            def shutdown(self): pass
    """,
    "vllm/v1/engine/core_client.py": "class AsyncMPClient:\n    async def add_request_async(self, request): pass\n",
    "vllm/v1/core/sched/scheduler.py": "class Scheduler:\n    def update_from_output(self, a, b): pass\n",
    "vllm/v1/worker/worker_base.py": "class WorkerWrapperBase:\n    def execute_model(self, s): pass\n",
    "vllm/v1/worker/gpu_model_runner.py": """
        import torch
        class AsyncGPUModelRunnerOutput:
            def __init__(self, model_runner_output, sampled_token_ids, async_output_copy_stream, vocab_size):
                self.async_copy_ready_event = torch.cuda.Event(blocking=True)
                with torch.cuda.stream(async_output_copy_stream):
                    self.async_copy_ready_event.record()
            def get_output(self):
                self.async_copy_ready_event.synchronize()
        class AsyncGPUPoolingModelRunnerOutput:
            def __init__(self, model_runner_output, raw_pooler_output, finished_mask, async_output_copy_stream):
                self.async_copy_ready_event = torch.cuda.Event(blocking=True)
                self.async_copy_ready_event.record()
            def get_output(self):
                self.async_copy_ready_event.synchronize()
    """,
    "vllm/v1/worker/gpu/async_utils.py": """
        import torch
        class AsyncOutput:
            def __init__(self, model_runner_output, sampler_output, num_sampled_tokens, main_stream, copy_stream,
                         check_ep_fault, pending_aux_output):
                self.copy_event = torch.cuda.Event(blocking=True)
                self.copy_event.record(copy_stream)
            def get_output(self):
                self.copy_event.synchronize()
                return self.model_runner_output
        class AsyncPoolingOutput:
            def __init__(self, model_runner_output, pooler_output, finished_mask, main_stream, copy_stream):
                self.copy_event = torch.cuda.Event(blocking=True)
                self.copy_event.record(copy_stream)
            def get_output(self):
                pooler_output = self.pooler_output_cpu
                self.copy_event.synchronize()
    """,
}


def _tree(tmp_path, **changes):
    """The synthetic vLLM with ``changes`` (module path -> (old, new) text replacements, or new files)."""
    for rel, text in TREE.items():
        text = textwrap.dedent(text)
        for old, new in changes.pop(rel, ()):
            assert old in text, (rel, old)
            text = text.replace(old, new)
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    for rel, text in changes.items():  # new files
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return str(tmp_path)


EXECUTOR = "vllm/v1/executor/multiproc_executor.py"
QUEUE = "vllm/distributed/device_communicators/shm_broadcast.py"
RAY = "vllm/v1/executor/ray_executor_v2.py"
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
V2_OUTPUT = "vllm/v1/worker/gpu/async_utils.py"


@pytest.mark.parametrize("changes, failure", [
    ({}, None),
    ({QUEUE: [("def dequeue(self, timeout=None, indefinite=False)",
               "def dequeue(self, timeout=None, indefinite=False, cancel=None)")]},
     "MessageQueue.dequeue(timeout, indefinite, cancel): ours does not take 'cancel'"),
    ({QUEUE: [("def export_handle(self): pass", "def export_handle(self): pass\n    def drain(self): pass")]},
     "MessageQueue.drain: vLLM's class has it, hotloop's does not"),
    ({EXECUTOR: [("MessageQueue(2, 2, max_chunk_bytes=10)", "MessageQueue(2, 2, max_chunk_bytes=10, numa=1)")]},
     "with keywords ['max_chunk_bytes', 'numa']: ours does not take 'numa'"),
    ({EXECUTOR: [("ranks = handle.local_reader_ranks", "ranks = handle.buffer_handle")]},
     "Handle.buffer_handle read outside the queue module is on hotloop's handle"),
    ({"vllm/v1/worker/poll.py": "def f(mq, m, t):\n    return mq._wait_until_readable(m, t)\n"},
     "_wait_until_readable is used only by its own class: also read in vllm/v1/worker/poll.py"),
    ({"vllm/v1/worker/write.py": "def f(mq):\n    return mq.acquire_write()\n"},
     "acquire_write left out"),
    ({EXECUTOR: [("return [mq.dequeue(timeout=deadline) for mq in response_mqs]",
                  "return [mq.dequeue() for mq in response_mqs]")]},
     "it does not read ['deadline']"),
    ({"vllm/v1/engine/core.py": [("self.input_queue = queue.Queue()", "self.inputs = queue.Queue()")]},
     "EngineCoreProc.__init__ assigns self.input_queue"),
    ({"vllm/v1/engine/core.py": [("def _process_engine_step(self)", "def _process_step(self)")]},
     "EngineCoreProc._process_engine_step"),
    ({"vllm/v1/engine/core.py": [("self.output_queue = queue.Queue()", "self.outputs = queue.Queue()")]},
     "EngineCoreProc.__init__ assigns self.output_queue"),
    ({"vllm/v1/engine/core.py": [("target=self.process_output_sockets", "target=process_output_sockets")]},
     "starts its output thread on self.process_output_sockets"),
    ({"vllm/v1/engine/core.py": [("coord_output_path, engine_index):", "coord_output_path, engine_index, ctx):")]},
     "arguments ['self', 'output_paths', 'coord_output_path', 'engine_index', 'ctx']"),
    ({"vllm/v1/engine/core.py": [("encoder.encode(output[1])", "encoder.encode(output[0])")]},
     "is a body output_send mirrors (vLLM ?): digest"),  # any change to what it does, its names all kept
    ({"vllm/v1/engine/core.py": [("encoder.encode_into(output[1], bytearray())", "encoder.encode(output[1])")]},
     "does not use ['encode_into']"),
    ({"vllm/v1/engine/core.py": [("from vllm.v1.serial_utils import MsgpackEncoder",
                                  "from vllm.v1 import serial_utils")]},
     "imports make_zmq_socket and MsgpackEncoder by name (output_send takes them from it): missing ['MsgpackEncoder']"),
    ({"vllm/v1/engine/core.py": [("self.output_queue.put_nowait((0, None))", "self.output_queue.join()")]},
     "only put_nowait, put and get of an output_queue: also {'join': ['vllm/v1/engine/core.py']}"),
    ({"vllm/v1/engine/core.py": [("target=self.process_input_sockets", "target=process_input_sockets")]},
     "starts its input thread on self.process_input_sockets"),
    ({"vllm/v1/engine/core.py": [("decoder.decode([])))", "decoder.decode([b''])))")]},
     "EngineCoreProc.process_input_sockets is a body input_read mirrors (vLLM ?): digest"),
    ({"vllm/v1/engine/core.py": [('FT_UTILITY_METHOD = "ft_command"\n', "")]},
     "MultiModalCacheMissError and FT_UTILITY_METHOD by name (input_read takes them from it): missing "
     "['FT_UTILITY_METHOD']"),
    ({"vllm/v1/engine/core.py": [("self.input_queue.get(block=True)", "self.input_queue.join()")]},
     "the queue.Queue methods EngineInputQueue has of an input_queue: also {'join': ['vllm/v1/engine/core.py']}"),
    ({"vllm/v1/engine/core.py": [("self.input_queue.get(block=True)", "self.input_queue.mutex.acquire()")]},
     "EngineInputQueue has of an input_queue: also {'mutex': ['vllm/v1/engine/core.py']}"),
    ({"vllm/plugins/__init__.py": [('"vllm.general_plugins"', '"vllm.plugins"')]}, "vllm.general_plugins"),
    ({EXECUTOR: [("def sample_tokens", "def sample")]}, "MultiprocExecutor.sample_tokens"),
    ({RAY: [("    def run(self): pass", "    def start(self): pass")]}, "RayWorkerHandle.run"),
    ({RAY: [("    node_id: str", "    node: str")]}, "RayWorkerHandle has actor, rank and node_id"),
    ({RAY: [("        for handle in self.ray_worker_handles:\n            handle.run()\n"
             "        self.start_worker_monitor()",
             "        self.start_worker_monitor()\n"
             "        for handle in self.ray_worker_handles:\n            handle.run()")]},
     "runs every handle, then starts its monitor"),
    ({RAY: [("        self.response_mqs = []\n", "")]}, "not set there: ['response_mqs']"),
    ({V2_OUTPUT: [("main_stream, copy_stream,\n", "main_stream, output_stream,\n")]},
     "V2's AsyncOutput.__init__ takes copy_stream and records self.copy_event, get_output() synchronizes it "
     "(vllm/v1/worker/gpu/async_utils.py; device_wait wraps it): no copy_stream parameter"),
    ({V2_OUTPUT: [("        pooler_output = self.pooler_output_cpu\n        self.copy_event.synchronize()",
                   "        pooler_output = self.pooler_output_cpu\n        self.copy_event.query()")]},
     "AsyncPoolingOutput.__init__ takes copy_stream and records self.copy_event, get_output() synchronizes it "
     "(vllm/v1/worker/gpu/async_utils.py; device_wait wraps it): get_output() does not call "
     "self.copy_event.synchronize()"),
    ({V2_OUTPUT: [("    def __init__(self, model_runner_output, pooler_output", "    def __init__(self, pooler_output")]},
     None),  # another parameter may change: only the stream is read by name
    ({V1_RUNNER: [("            self.async_copy_ready_event.record()", "            pass")]},
     "V1's AsyncGPUModelRunnerOutput.__init__ takes async_output_copy_stream and records "
     "self.async_copy_ready_event, get_output() synchronizes it (vllm/v1/worker/gpu_model_runner.py; device_wait "
     "wraps it): __init__ does not call self.async_copy_ready_event.record()"),
    ({V1_RUNNER: [("class AsyncGPUPoolingModelRunnerOutput", "class AsyncGPUPoolerOutput")]},
     "AsyncGPUPoolingModelRunnerOutput.__init__ takes async_output_copy_stream and records "
     "self.async_copy_ready_event, get_output() synchronizes it (vllm/v1/worker/gpu_model_runner.py; device_wait "
     "wraps it): the class is not there"),
])
def test_the_check_catches_what_would_break_hotloop(tmp_path, changes, failure, synthetic_body_mirrored):
    version, findings = source_check.check(_tree(tmp_path, **changes))
    assert version == "0.33.0"
    failed = _failed(findings)
    if failure is None:
        assert not failed
    else:
        assert len(failed) == 1 and failure in failed[0], failed


@pytest.fixture
def synthetic_body_mirrored(monkeypatch):
    """The synthetic process_input_sockets and process_output_sockets count as mirrored, as vLLM's real ones are
    (input_read.MIRRORED, output_send.MIRRORED)."""
    tree = ast.parse(textwrap.dedent(TREE["vllm/v1/engine/core.py"]))
    for name, module in (("process_input_sockets", input_read), ("process_output_sockets", output_send)):
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        monkeypatch.setitem(module.MIRRORED, mirrored.tree_digest(fn), "the synthetic one")


def test_command_line_exit_status(tmp_path, capsys, synthetic_body_mirrored):
    assert source_check.main([_tree(tmp_path)]) == 0
    assert "vLLM 0.33.0" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.mkdir()
    assert source_check.main([_tree(bad, **{EXECUTOR: [("def sample_tokens", "def sample")]})]) == 1
    assert "FAIL MultiprocExecutor.sample_tokens" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no vllm/distributed/device_communicators/shm_broadcast.py"):
        source_check.check(str(tmp_path / "bad" / "vllm" / "v1"))
