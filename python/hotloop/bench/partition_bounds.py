"""How fast each partition case of tests/test_network_faults.py is seen, over many partitions.

    python -m hotloop.bench.partition_bounds [ROUNDS]      (default 20; root, iproute2 and nftables, as the tests;
                                                            from a source checkout: it runs the checkout's tests)

Runs the partition tests ROUNDS times (pytest -s: each prints "<case>: <who>'s DeadPeerError after X s") and
prints, per case and side, p50 / p99 / max of the time from the cut to the error, with the peer timeout in force
(HOTLOOP_PEER_TIMEOUT_S, default 3 s). The goal: every case within 5 s at p99 with default settings."""

import os
import re
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.normpath(os.path.join(HERE, "..", "..", "..", "tests", "test_network_faults.py"))
FIGURE = re.compile(r"^(.*?): (.*?)'s DeadPeerError after ([0-9.]+) s(?:, (.*?)'s after ([0-9.]+) s)?$")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(rounds: int) -> int:
    if not os.path.exists(TESTS):
        sys.exit(f"partition_bounds runs the partition tests of a source checkout; there is none at {TESTS}")
    seen = defaultdict(list)
    failed = 0
    for i in range(rounds):
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", TESTS, "-k",
                              "partitioned or drop"], capture_output=True, text=True)
        failed += run.returncode != 0
        for line in run.stdout.splitlines():
            m = FIGURE.match(line.strip().lstrip("."))
            if m:
                seen[(m[1], m[2])].append(float(m[3]))
                if m[4]:
                    seen[(m[1], m[4])].append(float(m[5]))
        print(f"round {i + 1}/{rounds}: exit {run.returncode}", file=sys.stderr, flush=True)
    timeout = os.environ.get("HOTLOOP_PEER_TIMEOUT_S", "3 (default)")
    print(f"time from the cut to DeadPeerError, s ({rounds} rounds, HOTLOOP_PEER_TIMEOUT_S={timeout}; "
          f"{failed} rounds with a failed test)")
    print(f"{'case':<34} {'side':<16} {'n':>3} {'p50':>6} {'p99':>6} {'max':>6}")
    for (case, side), xs in sorted(seen.items()):
        print(f"{case:<34} {side:<16} {len(xs):>3} {percentile(xs, 50):>6.2f} {percentile(xs, 99):>6.2f} "
              f"{max(xs):>6.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
