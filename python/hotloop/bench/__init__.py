"""hotloop's Python benchmarks: each runs the baseline it replaces in the same run and reports the ratio.

Run them with ``hotloop bench [NAME ...] [--full] [--json PATH]``; ``BENCHMARKS`` maps names to runners. Each
runner returns its results, with the verdict on each goal it states under ``"goals"`` (report.Goal), and its
printed tables (report.Report). ``GOALS`` maps a benchmark to the function that lists its goals for given
results, so a record written before its benchmark stored verdicts can still be judged.
"""

from hotloop.bench import engine_bench, notifier_bench, orchestrator_bench, queue_bench, wait_bench

BENCHMARKS = {
    "wait": wait_bench.run,
    "queue": queue_bench.run,
    "notifier": notifier_bench.run,
    "engine": engine_bench.run,
    "orchestrator": orchestrator_bench.run,
}

GOALS = {
    "wait": wait_bench.goals,
    "queue": queue_bench.goals,
    "notifier": notifier_bench.goals,
}
