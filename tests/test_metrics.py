"""Wait metrics from Python: Waiter.stats, step notifier stats, queue reader stats, collect/counted scopes,
registration, and a Prometheus scrape of a running engine (its phase counters move under load, stay still
when idle)."""

import gc
import threading

import pytest
from conftest import require_torch, wait_until

import hotloop
from hotloop import metrics

WAIT_KEYS = {"waits", "phase_ns", "spin_iterations", "yields", "parks", "safety_wakeups", "wake_latency"}


def _total(stats):
    return sum(stats["waits"].values())


def test_waiter_stats_count_each_wait_once_in_the_phase_it_ended():
    flag = hotloop.Flag()
    w = hotloop.Waiter([flag], hotloop.WaitPolicy(spin_us=0, yield_us=0))
    assert set(w.stats) == WAIT_KEYS and _total(w.stats) == 0
    assert w.wait(timeout=0) == []
    assert w.wait(timeout=0.01) == []
    assert w.stats["waits"]["timeout"] == 2
    assert w.stats["parks"] >= 1 and w.stats["phase_ns"]["park"] >= 10_000_000  # slept to its deadline
    flag.set()
    assert w.wait(timeout=5) == [flag]
    assert w.stats["waits"]["immediate"] == 1
    flag.clear()
    got = []
    waiter = threading.Thread(target=lambda: got.append(w.wait(timeout=30)))
    waiter.start()
    wait_until(lambda: flag.parked, what="the waiter parking")
    flag.set()
    waiter.join()
    assert got == [[flag]] and w.last_phase == "park"
    stats = w.stats
    assert _total(stats) == 4 and stats["waits"]["park"] == 1
    # The set rang a parked waiter: it stamped the ring, and the waiter measured ring -> running.
    assert stats["wake_latency"]["count"] == 1 and stats["wake_latency"]["sum_ns"] > 0
    split = metrics.wait_split(stats)
    assert split["waits"] == 4 and abs(sum(split[p] for p in metrics.WAIT_ENDS) - 1.0) < 1e-9


def test_process_snapshot_counts_waits_of_every_thread_including_exited_ones():
    before = metrics.snapshot()["process"]
    flag = hotloop.Flag()
    flag.set()

    def waits():
        for _ in range(100):
            hotloop.wait_any([flag], timeout=0)

    threads = [threading.Thread(target=waits) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics.snapshot()["process"]
    assert after["waits"]["immediate"] - before["waits"]["immediate"] >= 400


def test_step_notifier_stats_count_marks_completions_and_completion_to_waiter_latency():
    n = hotloop.HostStepNotifier()
    a, b = n.mark(), n.mark()
    assert n.stats["marks"] == 2 and n.stats["completions"] == 0
    until = n.until(b)
    w = hotloop.Waiter([until], hotloop.WaitPolicy(spin_us=0, yield_us=0))
    n.complete(a)
    got = []
    waiter = threading.Thread(target=lambda: got.append(w.wait(timeout=30)))
    waiter.start()
    wait_until(lambda: until.parked, what="the waiter parking")
    n.complete(b)
    waiter.join()
    assert got == [[until]] and n.stats["completions"] == 2
    # The wait was under way when the step completed: completion -> running was measured, once.
    latency = n.stats["wake_latency"]
    assert latency["count"] == 1 and w.stats["wake_latency"]["count"] == 1
    assert metrics.latency_quantile(latency, 0.5) > 0
    # A wait that starts after the completion did not wait for it.
    assert hotloop.Waiter([until]).wait(timeout=0) == [until]
    assert n.stats["wake_latency"]["count"] == 1


def test_queue_reader_stats_count_its_waits():
    q = hotloop.MessageQueue(1)
    reader = hotloop.MessageQueue.create_from_handle(q.export_handle(), 0)
    try:
        q.wait_until_ready(30)
        with pytest.raises(TimeoutError):
            reader.dequeue_bytes(timeout=0.01)  # nothing written: a timed-out wait
        q.enqueue_bytes(b"x")
        assert bytes(reader.dequeue_bytes(timeout=5)) == b"x"
        stats = reader.wait_stats
        assert set(stats) == WAIT_KEYS
        assert stats["waits"]["timeout"] >= 1
    finally:
        reader.close()
        q.close()


def test_collect_routes_a_threads_waits_and_scopes_nest():
    outer, inner = metrics.WaitMetrics(), metrics.WaitMetrics()
    flag = hotloop.Flag()
    flag.set()
    with metrics.collect(outer):
        hotloop.wait_any([flag], timeout=0)
        with metrics.collect(inner):
            hotloop.wait_any([flag], timeout=0)
        hotloop.wait_any([flag], timeout=0)
        other = threading.Thread(target=hotloop.wait_any, args=([flag],), kwargs={"timeout": 0})
        other.start()  # another thread's waits are not this thread's scope
        other.join()
    hotloop.wait_any([flag], timeout=0)
    assert _total(outer.snapshot()) == 2
    assert _total(inner.snapshot()) == 1


def test_register_labels_and_unregister():
    m = metrics.WaitMetrics()
    with pytest.raises(ValueError, match="scope and phase"):
        metrics.register(m.snapshot, phase="x")
    with pytest.raises(ValueError, match="scope and phase"):
        metrics.register(m.snapshot, **{"not an identifier": "x"})
    handle = metrics.register(m.snapshot, component="test", replica=3)
    mine = [e for e in metrics.snapshot()["registered"] if e["labels"].get("component") == "test"]
    assert mine == [{"labels": {"component": "test", "replica": "3"}, "stats": m.snapshot()}]
    metrics.unregister(handle)
    metrics.unregister(handle)  # harmless
    assert not [e for e in metrics.snapshot()["registered"] if e["labels"].get("component") == "test"]


def test_a_registered_bound_method_goes_away_with_its_object():
    class Loop:
        def figures(self):
            return {"counters": {"test_loops": 1}}

    loop = Loop()
    metrics.register(loop.figures, component="weak")
    assert [e for e in metrics.snapshot()["registered"] if e["labels"].get("component") == "weak"]
    del loop
    gc.collect()
    assert not [e for e in metrics.snapshot()["registered"] if e["labels"].get("component") == "weak"]


# ---- Prometheus ------------------------------------------------------------------------------------------------


def _sum(registry, name, **match):
    """The sum of a metric's samples whose labels include `match` (scraped through prometheus_client)."""
    total = 0.0
    for family in registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                total += s.value
    return total


def test_prometheus_exposition_has_the_conventional_names():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    metrics.PrometheusCollector(registry=registry)
    text = prometheus_client.generate_latest(registry).decode()
    for name in ("hotloop_wait_wakeups_total", "hotloop_wait_phase_seconds_total",
                 "hotloop_wait_spin_iterations_total", "hotloop_wait_parks_total", "hotloop_wake_latency_seconds_bucket",
                 "hotloop_wake_latency_seconds_count", "hotloop_wake_latency_seconds_sum"):
        assert f"\n{name}{{" in text, name
    assert 'hotloop_wait_wakeups_total{phase="park",scope="process"}' in text
    assert 'le="+Inf"' in text


def test_prometheus_scrape_of_a_running_engine_moves_under_load_and_stays_still_when_idle():
    prometheus_client = pytest.importorskip("prometheus_client")
    require_torch()
    from hotloop.engine import AddRequest, EngineCore
    from hotloop.engine import tokenizer as tk

    registry = prometheus_client.CollectorRegistry()
    metrics.PrometheusCollector(registry=registry)
    core = EngineCore("tiny", wait_mode="hotloop", max_tokens_per_step=24)
    core.metrics_labels = {"replica": "test-engine"}
    engine = {"component": "engine", "wait_mode": "hotloop", "replica": "test-engine"}
    steps = {"component": "engine_steps", "wait_mode": "hotloop", "replica": "test-engine"}
    t = threading.Thread(target=core.run)
    t.start()
    try:
        def serve(n):
            for i in range(n):
                core.input_queue.put(AddRequest(f"r{i}-{n}", tk.encode(f"request {i}"), 8))
            done = 0
            while done < n:
                done += sum(o.finished for o in core.output_queue.get(timeout=60))

        serve(4)
        loaded = _sum(registry, "hotloop_wait_wakeups_total", **engine)
        assert loaded > 0, "the engine's waits under load did not show up in the scrape"
        assert _sum(registry, "hotloop_step_marks_total", **steps) > 0
        assert _sum(registry, "hotloop_step_completions_total", **steps) > 0

        # Idle: the loop parks in one wait that does not return, so nothing moves.
        def scrape():
            return ({p: _sum(registry, "hotloop_wait_wakeups_total", phase=p, **engine) for p in metrics.WAIT_ENDS},
                    {p: _sum(registry, "hotloop_wait_phase_seconds_total", phase=p, **engine) for p in metrics.PHASES})

        wait_until(lambda: core.input_queue.parked, what="the engine loop parking")
        idle, idle_seconds = scrape()
        threading.Event().wait(0.5)  # idle time, not a poll: the scrape after it must read the same
        assert scrape() == (idle, idle_seconds)

        serve(4)  # load again: the counters move again
        assert _sum(registry, "hotloop_wait_wakeups_total", **engine) > sum(idle.values())
    finally:
        core.input_queue.put(None)
        t.join(30)
    assert not t.is_alive()
    # A stopped engine is no longer exported.
    assert _sum(registry, "hotloop_wait_wakeups_total", component="engine", replica="test-engine") == 0
