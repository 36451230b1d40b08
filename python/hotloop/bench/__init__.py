"""hotloop's Python benchmarks: each runs the baseline it replaces in the same run and reports the ratio.

Run them with ``hotloop bench [NAME ...] [--full] [--json PATH]``; ``BENCHMARKS`` maps names to runners.
"""

from hotloop.bench import engine_bench, notifier_bench, orchestrator_bench, queue_bench, wait_bench

BENCHMARKS = {
    "wait": wait_bench.run,
    "queue": queue_bench.run,
    "notifier": notifier_bench.run,
    "engine": engine_bench.run,
    "orchestrator": orchestrator_bench.run,
}
