"""The bench report page: tables are found in any benchmark's results, every benchmark gets its section and
plots, and the page still comes out (with a note) without matplotlib."""

import os

import pytest

from hotloop.bench import report_page

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
