"""One end of a remote queue on a simulated node (hotloop.testing.netns.Nodes), for tests/test_network_faults.py.

    python net_fault_node.py writer CONFIG_JSON        (see writer())
    python net_fault_node.py reader HANDLE_PATH RANK
    python net_fault_node.py link_rank ADDRESS PORT_PATH     (a liveness link's rank end, listening on ADDRESS)
    python net_fault_node.py link_engine ADDRESS PORT_PATH   (its engine end)

Each prints JSON lines on stdout: the writer {"ready"}, then {"error", "t", "sent"} if enqueue raises (it stops
sending then), then {"sent", "closed_in"} after close() (with "exit": {"sent", "exiting"}, and the process exits
with the queue still open in a module global); a reader {"attached"}, then {"end", "t", "got", "error"}
where got is the sequence numbers read, in order; a link's rank end {"listening"}, then {"link_end", "t", "why"};
its engine end {"linked"}, then {"link_lost", "t", "why"}. "t" is CLOCK_MONOTONIC, one clock for every namespace."""

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
    hotloop.testing.delay_proxy on this node), look (between paced sends, look every 50 ms whether a reader left,
    and send at once if one did: an idle writer's error comes when its reader's connection ends, not at its next
    message)."""
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
        if period and c.get("look"):
            next_send = time.monotonic() + period
            while time.monotonic() < next_send and len(q.network_stats["attached"]) == c["n_reader"]:
                time.sleep(0.05)  # a look at the peers: an idle writer has no wait of its own
        elif period:
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


LINK_TOKEN = b"net-fault-link-t"


def link_rank(address, port_path):
    from hotloop.engine.executors import liveness

    listener = liveness.listen(address)
    with open(port_path + ".part", "w") as f:
        f.write(str(listener.getsockname()[1]))
    os.rename(port_path + ".part", port_path)
    say(listening=True)
    liveness.hold(listener, LINK_TOKEN, 60.0, lambda why: say(link_end=True, t=time.monotonic(), why=why))


def link_engine(address, port_path):
    from hotloop.engine.executors import liveness

    while not os.path.exists(port_path):
        time.sleep(0.02)
    with open(port_path) as f:
        port = int(f.read())
    watcher = liveness.LinkWatcher(lambda rank, why: say(link_lost=True, t=time.monotonic(), why=why))
    watcher.connect(0, address, port, LINK_TOKEN, 10.0)
    watcher.start()
    say(linked=True)
    import threading

    threading.Event().wait()  # held until the test ends (Nodes.close kills this process)


if __name__ == "__main__":
    {"writer": writer, "reader": reader, "link_rank": link_rank, "link_engine": link_engine}[sys.argv[1]](*sys.argv[2:])
