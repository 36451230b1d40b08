"""One end of a remote queue on a simulated node (hotloop.testing.netns.Nodes), for tests/test_network_faults.py.

    python net_fault_node.py writer HANDLE_PATH N_READER ADDRESS DEAD_READER RATE SECONDS [close|exit]
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


def writer(handle_path, n_reader, address, dead_reader, rate, seconds, ending="close"):
    from hotloop import MessageQueue

    q = MessageQueue(int(n_reader), 0, connect_ip=address, dead_reader=dead_reader)
    with open(handle_path + ".part", "wb") as f:
        pickle.dump(q.export_handle(), f)
    os.rename(handle_path + ".part", handle_path)
    q.wait_until_ready(timeout=30)
    say(ready=True)
    period, end, i = 1.0 / float(rate), time.monotonic() + float(seconds), 0
    while time.monotonic() < end:
        try:
            q.enqueue({"i": i, "pad": b"x" * 200}, timeout=5.0)
        except Exception as e:  # noqa: BLE001  (reported: the test asserts what it was)
            say(error=f"{type(e).__name__}: {e}", t=time.monotonic(), sent=i)
            break
        i += 1
        time.sleep(period)
    if ending == "exit":
        _kept.append(q)
        say(sent=i, exiting=time.monotonic())
        return
    t0 = time.monotonic()
    q.close()
    say(sent=i, closed_in=time.monotonic() - t0)


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
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
            break
    say(end=True, t=time.monotonic(), got=got, error=error)
    q.close()


if __name__ == "__main__":
    {"writer": writer, "reader": reader}[sys.argv[1]](*sys.argv[2:])
