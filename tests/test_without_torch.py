"""hotloop without torch (a plain `pip install hotloop`; torch is the extra "engine"): the core imports and works,
and what needs torch says what to install. Each check runs in a child process where torch cannot be imported
(``sys.modules["torch"] = None``, as Python does for a blocked import), so this runs beside torch too;
scripts/test_pythons.sh runs the whole torch-free suite where torch is not installed at all."""

import subprocess
import sys

import pytest

BLOCK_TORCH = 'import sys\nsys.modules["torch"] = None\n'


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120)


def test_the_core_works_without_torch():
    out = _child('''
import hotloop, hotloop.cuda, hotloop.metrics
from hotloop import InputQueue, MessageQueue, HostStepNotifier, wait_any
with MessageQueue(1) as q:
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=10)
    q.enqueue({"step": 1, "ids": [1, 2, 3]})
    assert wait_any([r], timeout=5) == [r]
    assert r.dequeue(timeout=5) == {"step": 1, "ids": [1, 2, 3]}
    big = bytearray(range(256)) * 1000  # out-of-band: the serializer's path for buffers
    q.enqueue({"payload": big})
    assert r.dequeue(timeout=5)["payload"] == big
    r.close()
inputs, steps = InputQueue(), HostStepNotifier()
token = steps.mark()
steps.complete(token)
inputs.put("request")
assert len(wait_any([inputs, steps.until(token)], timeout=5)) == 2
assert hotloop.metrics.snapshot() is not None
assert sys.modules["torch"] is None
print("core ok")
''')
    assert out.returncode == 0 and "core ok" in out.stdout, out.stderr


def test_the_process_layer_stands_without_the_engine():
    """hotloop.stage_process is below the engine: it imports neither the engine nor torch."""
    out = _child('''
import hotloop.stage_process.stage, hotloop.stage_process.lifecycle
from hotloop.stage_process.messages import AbortRequest, ShutdownRequest, StageMessage, encoder
import msgspec
decoder = msgspec.msgpack.Decoder(StageMessage)
assert decoder.decode(encoder.encode(AbortRequest(["r-1"]))) == AbortRequest(["r-1"])
assert decoder.decode(encoder.encode(ShutdownRequest())) == ShutdownRequest()
engine = sorted(m for m in sys.modules if m == "hotloop.engine" or m.startswith("hotloop.engine."))
assert not engine, engine
print("process ok")
''')
    assert out.returncode == 0 and "process ok" in out.stdout, out.stderr


@pytest.mark.parametrize("module", ["hotloop.engine", "hotloop.orchestrator"])
def test_what_needs_torch_says_what_to_install(module):
    out = _child(f'''
try:
    import {module}
except ModuleNotFoundError as e:
    assert e.name == "torch", e.name
    print(e)
else:
    raise SystemExit("imported without torch")
''')
    assert out.returncode == 0, out.stderr
    assert "needs PyTorch" in out.stdout and "pip install torch==2.13.0" in out.stdout, out.stdout


def test_the_cli_without_torch():
    out = _child('''
from hotloop.cli import main
print("rc", main(["info"]), main(["soak", "--minutes", "0.01"]), main(["bench", "engine"]))
''')
    assert out.returncode == 0, out.stderr
    assert "rc 0 2 2" in out.stdout, out.stdout
    info_torch = [line for line in out.stdout.splitlines() if line.startswith("torch ")]
    assert info_torch and "not installed" in info_torch[0], out.stdout
    assert "hotloop soak: runs an engine" in out.stderr and "hotloop bench engine: runs the engine" in out.stderr
    assert out.stderr.count("pip install torch==2.13.0") == 2, out.stderr
