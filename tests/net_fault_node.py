"""One end of a remote queue on a simulated node (hotloop.testing.netns.Nodes), for tests/test_network_faults.py.

    python net_fault_node.py writer CONFIG_JSON        (see writer())
    python net_fault_node.py reader HANDLE_PATH RANK

Each prints JSON lines on stdout: the writer {"ready"}, then {"error", "t", "sent"} if enqueue raises (it stops
sending then), then {"sent", "closed_in"} after close() (with "exit": {"sent", "exiting"}, and the process exits
with the queue still open in a module global); a reader {"attached"}, then {"end", "t", "got", "error"}
where got is the sequence numbers read, in order. "t" is CLOCK_MONOTONIC, one clock for every namespace."""

import json
import os
import pickle
import sys
import time


def say(**msg):
    print(json.dumps(msg), flush=True)


_kept = []  # a queue left open at exit


def writer(config):
    """config (JSON): handle, n_reader, address, dead_reader, rate (messages a second; 0: as fast as enqueue goes),
    seconds or count (when to stop), ending ("close" or "exit"), delay_ms / jitter_ms (readers connect through a
    hotloop.testing.delay_proxy on this node)."""
    import subprocess

    from hotloop import MessageQueue

    c = json.loads(config)
    delayed = c.get("delay_ms") is not None
    # behind a proxy: bound on loopback, the handle names the proxy (the node's address, the same port)
    q = MessageQueue(c["n_reader"], 0, connect_ip=c["address"], bind_ip="127.0.0.1" if delayed else None,
                     dead_reader=c.get("dead_reader", "raise"))
    proxy = None
    if delayed:
        port = q.export_handle().remote_address.rsplit(":", 1)[1]
        proxy = subprocess.Popen([sys.executable, "-m", "hotloop.testing.delay_proxy", c["address"], port,
                                  "127.0.0.1", port, str(c["delay_ms"]), str(c.get("jitter_ms", 0)),
                                  str(2 * c["n_reader"])],  # a relayed reader: its node's stream, its presence
                                 stdout=subprocess.PIPE, text=True)
        assert proxy.stdout.readline().strip() == "ready"
    path = c["handle"]
    with open(path + ".part", "wb") as f:
        pickle.dump(q.export_handle(), f)
    os.rename(path + ".part", path)
    q.wait_until_ready(timeout=30)
    say(ready=True)
    period = 1.0 / c["rate"] if c.get("rate") else 0.0
    end, count, i = time.monotonic() + c.get("seconds", 1e9), c.get("count", 1 << 62), 0
    while time.monotonic() < end and i < count:
        try:
            q.enqueue({"i": i, "pad": b"x" * 200}, timeout=5.0)
        except Exception as e:  # noqa: BLE001  (reported: the test asserts what it was)
            say(error=f"{type(e).__name__}: {e}", t=time.monotonic(), sent=i)
            break
        i += 1
        if period:
            time.sleep(period)
    if c.get("ending") == "exit":
        _kept.append(q)
        say(sent=i, exiting=time.monotonic())
        return
    t0 = time.monotonic()
    q.close()
    say(sent=i, closed_in=time.monotonic() - t0)
    if proxy is not None:  # it ends once it delivered what each reader's connection carried, shutdown included
        try:
            proxy.wait(timeout=120)
        finally:
            proxy.kill()
            proxy.stdout.close()


def reader(handle_path, rank):
    from hotloop import MessageQueue

    while not os.path.exists(handle_path):
        time.sleep(0.02)
    with open(handle_path, "rb") as f:
        q = MessageQueue.create_from_handle(pickle.load(f), int(rank))
    say(attached=True)
    got, error = [], None
    while True:
        try:
            got.append(q.dequeue(timeout=60)["i"])
            if len(got) == 1:
                say(receiving=True)  # the test cuts links once every reader receives
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
            break
    say(end=True, t=time.monotonic(), got=got, error=error)
    q.close()


if __name__ == "__main__":
    {"writer": writer, "reader": reader}[sys.argv[1]](*sys.argv[2:])
