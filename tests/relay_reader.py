"""A remote reader process for tests/test_queue_relay.py: ``python relay_reader.py HANDLE_PATH RANK NODE``.

Attaches as RANK on NODE (through the node's relay), prints ``{"attached": pid}``, then reads ``{"i": ...}`` messages
until an error and prints ``{"end": true, "t", "got", "error"}`` ("t": CLOCK_MONOTONIC when the error came)."""

import json
import pickle
import sys
import time


def main(handle_path: str, rank: str, node: str) -> None:
    import os

    from hotloop import MessageQueue

    with open(handle_path, "rb") as f:
        q = MessageQueue.create_from_handle(pickle.load(f), int(rank), node=node)
    print(json.dumps({"attached": os.getpid()}), flush=True)
    got, error = [], None
    while True:
        try:
            got.append(q.dequeue(timeout=60)["i"])
        except Exception as e:  # noqa: BLE001  (reported: the test asserts what it was)
            error = f"{type(e).__name__}: {e}"
            break
    print(json.dumps({"end": True, "t": time.monotonic(), "got": got, "error": error}), flush=True)
    q.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
