"""The installed hotloop exercised briefly (scripts/test_aarch64.sh runs it in an aarch64 Python under qemu-user).

Not the test suite (its timing checks assume a real CPU, and an emulator is 10-50x slower): the paths a user's
first minute takes, each checked. A wait on a flag set by another thread, with a socket in the same wait (the
mixed park: the backend `hotloop info` names); an InputQueue fed by a thread; a MessageQueue round trip between
this process and a forked reader through shared memory, which parks on its doorbell. Prints one line per check
and the park backend, then "aarch64 smoke: ok".
"""

import os
import platform
import socket
import sys
import threading

import hotloop
from hotloop import _core


def main() -> None:
    assert platform.machine() == "aarch64", platform.machine()
    assert not hotloop.__file__.startswith(os.path.join(os.getcwd(), "python")), hotloop.__file__
    park = _core.park_backend()
    print(f"hotloop {hotloop.__version__} from {os.path.dirname(hotloop.__file__)} on {platform.machine()}, "
          f"Python {platform.python_version()}; park backend {park['backend']}"
          + (f" ({park['reason']})" if park["reason"] else ""))

    flag = hotloop.Flag()
    a, b = socket.socketpair()
    waiter = hotloop.Waiter([flag, a])
    threading.Timer(0.2, flag.set).start()
    ready = waiter.wait(timeout=30.0)
    assert ready == [flag], ready
    flag.clear()
    threading.Timer(0.2, b.send, args=(b"x",)).start()
    ready = waiter.wait(timeout=30.0)
    assert ready == [a], ready
    print("wait on a flag and a socket (the mixed park): woken by each")

    inputs = hotloop.InputQueue()
    feeder = threading.Thread(target=lambda: [inputs.put(i) for i in range(100)])
    feeder.start()
    got = []
    while len(got) < 100:
        got.append(inputs.get(timeout=30.0))
    feeder.join()
    assert got == list(range(100)), got
    print("InputQueue: 100 items from a thread, in order")

    q = hotloop.MessageQueue(1)
    handle = q.export_handle()
    pid = os.fork()
    if pid == 0:
        try:
            r = hotloop.MessageQueue.create_from_handle(handle, 0)
            r.wait_until_ready(timeout=60.0)
            for i in range(50):
                msg = r.dequeue(timeout=60.0)
                assert msg == {"i": i, "data": bytes(range(i % 256)) * 3}, msg
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - reported through the exit code
            print("reader:", repr(e), file=sys.stderr)
            os._exit(1)
    q.wait_until_ready(timeout=60.0)
    for i in range(50):
        q.enqueue({"i": i, "data": bytes(range(i % 256)) * 3})
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    print("MessageQueue: 50 messages to a forked reader through shared memory, each intact")
    print("aarch64 smoke: ok")


if __name__ == "__main__":
    main()
