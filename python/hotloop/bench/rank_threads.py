"""Torch threads per worker rank, A/B in one run: the multiproc engine at TP=N with each rank on its share of the
node's CPUs (hotloop's default, executors/worker.py: rank_threads) against torch's default of every CPU in every
rank (OMP_NUM_THREADS set to the CPU count), alternated; single-stream decode tok/s, medians over the rounds.

    python -m hotloop.bench.rank_threads [TP] [ROUNDS]
"""

import os
import statistics
import subprocess
import sys
import threading
import time

TOKENS = 64


def one_engine(tp: int) -> float:
    """tok/s of one 64-token greedy stream after a warm-up, on a fresh multiproc engine."""
    from hotloop.engine import AddRequest, EngineCore

    core = EngineCore("tiny", executor="multiproc", tp=tp)
    t = threading.Thread(target=core.run)
    t.start()

    def stream(rid: str) -> int:
        core.input_queue.put(AddRequest(rid, [1, 2, 3, 4], TOKENS, ignore_eos=True))
        got = 0
        while True:
            for o in core.output_queue.get(timeout=300):
                got += len(o.new_token_ids)
                if o.finished:
                    return got

    stream("warm-up")
    t0 = time.monotonic()
    n = stream("timed")
    rate = n / (time.monotonic() - t0)
    core.input_queue.put(None)
    t.join()
    return rate


def main():
    if sys.argv[1:2] == ["--child"]:
        print(one_engine(int(sys.argv[2])))
        return
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    arms = {"share per rank (default)": {}, "every CPU per rank": {"OMP_NUM_THREADS": str(os.cpu_count())}}
    got = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm, extra in arms.items():
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | extra
            out = subprocess.run([sys.executable, "-m", "hotloop.bench.rank_threads", "--child", str(tp)], env=env,
                                 capture_output=True, text=True, check=True)
            got[arm].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {arm}: {got[arm][-1]:.0f} tok/s", file=sys.stderr)
    base = statistics.median(got["every CPU per rank"])
    for arm, rates in got.items():
        med = statistics.median(rates)
        print(f"TP={tp} {arm:26s} median {med:7.0f} tok/s (min {min(rates):.0f}, max {max(rates):.0f})  "
              f"x{med / base:.1f} of every-CPU")


if __name__ == "__main__":
    main()
