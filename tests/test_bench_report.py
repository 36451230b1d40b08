"""The bench report page: tables are found in any benchmark's results, every benchmark gets its section and
plots, goals are judged from the results and the verdict opens the page (a goal not met says so), and the page
still comes out (with a note) without matplotlib. In headless Chromium (tests/page_check.py; skipped without
Debian's chromium) the page loads with every image, no script error and nothing wider than a laptop's window."""

import copy
import os
import re

import page_check
import pytest

from hotloop.bench import report_page
from hotloop.bench.report import Goal, Report, check_goals, table, verdict_line

RECORD = {
    "info": {"python": "3.x"},
    "quick": True,
    "results": {
        "notifier": {"mode": "fake", "call_ns": {"done": 40.0, "mark": 28.0},
                     "completion_latency_us": {"host": {"p50_us": 3, "p99_us": 9}, "cb": {"p50_us": 5, "p99_us": 20}}},
        "orchestrator": {"event": {"idle_cpu_pct": 0.01, "gap_p99_ms": 3.0, "gap_p99_ms_spread": 1.0},
                         "poll": {"idle_cpu_pct": 3.0, "gap_p99_ms": 4.0, "gap_p99_ms_spread": 1.0}},
        "wait": {"periodic_split": {
            "fixed": {"ended": {"waits": 10, "immediate": 0.0, "spin": 0.2, "yield": 0.1, "park": 0.7, "timeout": 0.0},
                      "waiter_cpu_pct_of_core": 20.0, "reaction": {"n": 10, "p50_us": 9.0}},
            "adaptive": {"ended": {"waits": 10, "immediate": 0.0, "spin": 0.0, "yield": 0.0, "park": 1.0,
                                   "timeout": 0.0}, "waiter_cpu_pct_of_core": 2.0, "reaction": {"n": 10, "p50_us": 8.0}}},
            "method": {"seconds": 1.0}},
    },
}
# the short run of the issue: hotloop's waiter keeps 84.9 % of the reference, under the 95 % goal
GIL = {"no waiter (reference)": {"worker_pct_of_reference": 100.0, "reaction": {"n": 0, "p50_us": float("nan")}},
       "(i) is_set + sched_yield": {"worker_pct_of_reference": 88.0, "reaction": {"n": 9, "p50_us": 4200.0}},
       "(ii) poll() + sched_yield": {"worker_pct_of_reference": 97.0, "reaction": {"n": 9, "p50_us": 4300.0}},
       "(iii) hotloop Waiter.wait": {"worker_pct_of_reference": 84.9, "reaction": {"n": 9, "p50_us": 190.0}}}


def _record_with_goals():
    """RECORD with wait's GIL-damage table and its goals judged, and each benchmark's output as a Report."""
    record = copy.deepcopy(RECORD)
    wait = record["results"]["wait"]
    wait["gil_damage"] = copy.deepcopy(GIL)
    from hotloop.bench import wait_bench

    wait["goals"] = check_goals(wait_bench.goals(wait), wait)
    texts = {
        "wait": Report([table("(b) GIL damage: a worker thread next to each waiter",
                              ["waiter", "% of ref", "react p50 us"],
                              [[k, v["worker_pct_of_reference"], v["reaction"]["p50_us"]] for k, v in GIL.items()],
                              note="goal: hotloop keeps >= 95 % of the reference", key="gil_damage"),
                        table("(e) where waits end", ["policy", "CPU %"],
                              [[k, v["waiter_cpu_pct_of_core"]] for k, v in wait["periodic_split"].items()],
                              key="periodic_split")]),
        # a wide table: a dozen columns with long headers, as the engine's
        "orchestrator": Report([table("orchestrator A/B", ["loop"] + [f"TTFP c{c} p{q} ms" for c in (1, 8, 32, 64)
                                                                      for q in (50, 90, 99)],
                                      [[k] + [1234.5 * i for i in range(12)] for k in ("event", "poll")],
                                      note="a long note " * 40), "a paragraph"]),
        "notifier": "a plain text table\n" + "x" * 60,
    }
    return record, texts


@pytest.fixture(scope="module", autouse=True)
def matplotlib_fonts_loaded(tmp_path_factory):
    """matplotlib keeps the font files it used open for the life of the process (a cache, not a leak of the page
    writer's): draw the plots once before the per-test descriptor check starts."""
    report_page.draw(RECORD["results"], str(tmp_path_factory.mktemp("fonts")))


def test_tables_are_found_in_each_shape_of_results():
    tables = dict(report_page.find_tables(RECORD["results"]["notifier"]))
    assert tables[("call_ns",)] == {"done": {"call_ns": 40.0}, "mark": {"call_ns": 28.0}}
    assert tables[("completion_latency_us",)]["cb"] == {"p50_us": 5.0, "p99_us": 20.0}
    (path, rows), = report_page.find_tables(RECORD["results"]["orchestrator"])
    assert path == () and set(rows) == {"event", "poll"}
    (path, rows), = report_page.find_tables(RECORD["results"]["wait"])  # "method" is not a table
    assert path == ("periodic_split",) and rows["fixed"]["ended.park"] == 0.7
    assert report_page._columns(rows) == ["waiter_cpu_pct_of_core", "reaction.p50_us"]  # no counts, no splits


def test_the_page_has_every_benchmark_with_its_plots(tmp_path):
    pytest.importorskip("matplotlib")
    texts = {name: f"{name} table" for name in RECORD["results"]}
    page, images = report_page.write(RECORD, texts, str(tmp_path))
    html = open(page).read()
    for name in RECORD["results"]:
        section = html.split(f"<h2 id='{name}'>", 1)[1].split("<h2 ", 1)[0]
        assert f"{name} table" in section
        assert "<img src=" in section, f"no plot for {name}"
    assert os.path.join(str(tmp_path), "wait-periodic-split-ended.png") in images  # the spin/yield/park split
    assert all(os.path.getsize(p) > 0 for p in images)


def test_without_matplotlib_the_page_says_how_to_get_the_plots(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    page, images = report_page.write(RECORD, {n: n for n in RECORD["results"]}, str(tmp_path))
    assert images == []
    assert "pip install &#x27;hotloop[bench]&#x27;" in open(page).read()


def test_goals_are_judged_from_the_results():
    wait = {"gil_damage": GIL}
    v = Goal("keeps", "gil_damage", "(iii) hotloop Waiter.wait", "worker_pct_of_reference", ">=", 95.0,
             unit="%").check(wait)
    assert v["met"] is False and v["value"] == 84.9
    assert "84.9 %, goal >= 95 % (0.894x the goal)" in verdict_line("wait", v)
    assert verdict_line("wait", v).startswith("NOT met")
    v = Goal("faster", "gil_damage", "(iii) hotloop Waiter.wait", "reaction.p50_us", "<=", 1.0,
             against="(i) is_set + sched_yield").check(wait)
    assert v["met"] is True and v["value"] == pytest.approx(190 / 4200)
    v = Goal("faster", "gil_damage", "(iii) hotloop Waiter.wait", "reaction.p50_us", "<=", 1.0,
             against="no waiter (reference)").check(wait)  # nan p50: nothing to compare with
    assert v["met"] is None and "not measured" in verdict_line("wait", v)
    assert Goal("x", "nope", "r", "m", "<=", 1.0).check(wait)["met"] is None


def test_the_verdict_opens_the_page_and_says_not_met(tmp_path):
    record, texts = _record_with_goals()
    page, _ = report_page.write(record, texts, str(tmp_path))
    html = open(page).read()
    verdict = html.split("<h2 id='verdict'>", 1)[1].split("<h2 ", 1)[0]
    assert html.index("<h2 id='verdict'>") < html.index("<h2 id='wait'>")
    assert "2 of 4 goals met, 1 not met, 1 not measured" in verdict  # (a) idle_cpu is absent from this record
    row = re.search(r"<tr><td><span class='notmet'>NOT met</span></td><td>wait</td><td><a href='#([^']+)'>"
                    r"\(b\) GIL damage: the worker keeps[^<]*</a></td><td>([^<]*)</td>", verdict)
    assert row, verdict
    assert row.group(2).startswith("84.9 % of the reference, goal &gt;= 95 % of the reference")
    assert f"<li id='{row.group(1)}'>" in html.split("<h3 id='wait-gil-damage'>", 1)[1]  # the link leads to its table
    assert "No goal stated for: notifier, orchestrator" in verdict
    assert "<table><thead><tr><th>waiter</th>" in html  # tables are HTML tables


def test_the_plots_mark_the_goal_and_the_baseline(tmp_path):
    pytest.importorskip("matplotlib")
    record, _ = _record_with_goals()
    drawn, _ = report_page.draw(record["results"], str(tmp_path), report_page.verdicts(record))
    gil = [(caption, name) for key, caption, name in drawn["wait"] if key == "gil_damage"]
    assert gil == [("wait: gil_damage; the goals' figures, a black line at each goal", "wait-gil-damage.png")]
    import matplotlib.pyplot as plt

    goals = report_page._table_goals(record["results"]["wait"]["goals"], ("gil_damage",))
    rows = dict(report_page.find_tables(record["results"]["wait"]))[("gil_damage",)]
    fig = report_page._bar_figure(plt, rows, ["worker_pct_of_reference", "reaction.p50_us"], goals)
    try:
        pct, react = fig.axes[:2]
        assert [tuple(line.get_xdata()) for line in pct.lines] == [(95.0, 95.0)]  # the goal, on hotloop's row
        assert [tuple(line.get_xdata()) for line in react.lines] == [(4200.0, 4200.0)]  # the faster baseline
        import matplotlib.colors as mc

        def colours(ax):
            return [mc.to_hex(b.get_facecolor()) for b in ax.patches]

        c = report_page.COLOURS
        assert colours(react) == [c["other"], c["baseline"], c["baseline"], c[True]]  # baselines grey, a met goal
        assert colours(pct)[-1] == c[False]  # ... and a goal not met, red
        assert not fig.texts and fig.get_suptitle() == ""  # one title: the caption on the page
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert {"baseline", "goal not met", "goal line"} <= set(legend)
    finally:
        plt.close(fig)


@pytest.fixture
def chromium():
    if page_check.chromium() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; scripts/test.sh installs it)")


def test_the_page_loads_cleanly_in_chromium(tmp_path, chromium):
    pytest.importorskip("matplotlib")
    record, texts = _record_with_goals()
    page, images = report_page.write(record, texts, str(tmp_path))
    assert images
    assert page_check.problems(page) == []


def test_chromium_catches_a_missing_image_a_script_error_and_a_wide_table(tmp_path, chromium):
    (tmp_path / "index.html").write_text(
        "<!doctype html><html><head><title>t</title></head><body><img src='gone.png' alt='gone'>"
        "<script>undefinedFunction();</script>"
        "<table><tr>" + "<td>1234567890</td>" * 200 + "</tr></table><pre>" + "x" * 400 + "</pre></body></html>")
    found = "\n".join(page_check.problems(str(tmp_path / "index.html")))
    assert "missing image: gone.png" in found
    assert "script error" in found and "undefinedFunction" in found
    assert "page wider than the window" in found and "too wide: <table>" in found
