"""The report page of ``hotloop bench``: one HTML page that opens with the verdict on every goal, then every
benchmark's tables and plots; PNGs next to it.

Contract: ``write(record, texts, out_dir, extra_images)`` writes ``out_dir/index.html`` and one PNG per plot,
and returns ``(page path, [PNG paths])``. ``record`` is the JSON record of the run (``{"info", "quick",
"results": {name: data}}``), ``texts`` each benchmark's printed output (a report.Report of tables and paragraphs,
drawn as HTML tables; a plain str is shown as preformatted text), ``extra_images`` PNGs a benchmark drew itself
({name: [path]}, e.g. the engine's latency distributions).

The verdict: each benchmark's goals (report.Goal) judged on its results, as the benchmark stored them under
``"goals"``, or judged now (bench.GOALS) for a record written before benchmarks stored them. Every goal gets a
line, met or not, with the figure and the goal, linked to its table.

Plots are found in the data, so a benchmark needs no plotting code of its own: every table-like part of its
results (rows of numbers that share columns, or one dict of numbers; see find_tables) gets one figure of bar
charts, one panel per column (the goals' figures when the table has goals, else up to MAX_COLUMNS), with the
goal's row coloured by its verdict, its baseline row in grey and a black line at the goal; rows that record
where waits ended (an ``"ended"`` split, from hotloop.metrics) also get a stacked spin / yield / park bar. A
figure's title is its caption on the page (none inside the PNG). Without matplotlib the page still holds every
table and the verdict and says how to get the plots.

The page is static (no script), and narrow: text wraps, and a table too wide for the screen scrolls inside its
own box instead of widening the page (tests/page_check.py checks this in headless Chromium).
"""

from __future__ import annotations

import html
import math
import os
import re

from hotloop.bench.report import Table, check_goals, verdict_text, verdict_word

MAX_COLUMNS = 4  # panels per figure of a table without goals
SKIPPED = re.compile(r"(_spread|_runs|^n$|\.n$|wall_s)")
COLOURS = {True: "#55a868", False: "#c44e52", None: "#4c72b0", "baseline": "#8c8c8c", "other": "#a1b8d9"}
STYLE = """
body{font-family:system-ui,sans-serif;max-width:72rem;margin:0 auto;padding:0 1rem 3rem;line-height:1.4;color:#222}
h1{margin-top:1.2em}h2{margin-top:2em;border-bottom:1px solid #ddd}h3{font-size:1em;margin:1.6em 0 .4em}
p,li,td,th{overflow-wrap:break-word}
.box{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:13px;margin:.3em 0}
th,td{padding:.2em .6em;border-bottom:1px solid #e4e4e4;vertical-align:top}
th{text-align:right;background:#f4f4f4;font-weight:600}th:first-child,td:first-child{text-align:left}
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.note{font-size:13px;color:#444;margin:.3em 0}
pre{background:#f6f6f6;padding:1em;font-size:12px;margin:0}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
figure{margin:1em 0}figcaption{font-size:13px;color:#444}
.met{color:#1e7b34;font-weight:600;white-space:nowrap}.notmet{color:#b0282e;font-weight:700;white-space:nowrap}
.unmeasured{color:#8a6d00;font-weight:600;white-space:nowrap}
ul.goals{font-size:13px;padding-left:1.2em;margin:.3em 0}
table.verdict{font-size:14px}table.verdict th{text-align:left}
table.info td:last-child{overflow-wrap:anywhere}
"""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _flat_row(row: dict) -> dict | None:
    """A row's numeric columns, one nesting level flattened ("latency.p50_us"); None if it nests deeper."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if isinstance(v2, (dict, list)):
                    return None
                if _number(v2):
                    out[f"{k}.{k2}"] = float(v2)
        elif isinstance(v, list):
            continue
        elif _number(v):
            out[k] = float(v)
    return out


def find_tables(data, path=()) -> list[tuple[tuple, dict[str, dict]]]:
    """The table-like parts of a benchmark's results: (path, {row name: {column: number}}). A table: two or more
    records (dicts of numbers, or of dicts of numbers) that share a column; a series: a dict of numbers (one
    column, named after it); anything else is searched inside."""
    if not isinstance(data, dict):
        return []
    rows = {k: v for k, v in data.items() if isinstance(v, dict) and k != "method"}
    flat = {k: _flat_row(v) for k, v in rows.items()}
    if len(rows) >= 2 and all(flat.values()) and set.intersection(*(set(f) for f in flat.values())):
        return [(path, flat)]
    if not rows:
        series = {str(k): float(v) for k, v in data.items() if _number(v)}
        return [(path, {k: {path[-1] if path else "value": v} for k, v in series.items()})] if series else []
    found = []
    for k, v in rows.items():
        found += find_tables(v, path + (str(k),))
    return found


def _columns(rows: dict[str, dict]) -> list[str]:
    seen = []
    for r in rows.values():
        for c in r:
            if c not in seen and not SKIPPED.search(c) and not c.startswith("ended."):
                seen.append(c)
    return seen[:MAX_COLUMNS]


def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(parts)).strip("-").lower() or "plot"


# ---- the verdict -------------------------------------------------------------------------------------------------


def verdicts(record: dict) -> dict[str, list[dict]]:
    """Every benchmark's goal verdicts ({name: [verdict]}, [] for a benchmark that states no goal): those its
    results store, or, for a record written before they were stored, its goals judged on its results now."""
    from hotloop.bench import GOALS

    out = {}
    for bench, data in record["results"].items():
        if isinstance(data, dict) and isinstance(data.get("goals"), list):
            out[bench] = data["goals"]
        elif bench in GOALS and isinstance(data, dict):
            out[bench] = check_goals(GOALS[bench](data), data)
        else:
            out[bench] = []
    return out


def _table_goals(goals: list[dict], path: tuple) -> list[dict]:
    """The goals (report.Goal verdicts) of the table at `path` in a benchmark's results."""
    key = path[0] if len(path) == 1 else "" if not path else None
    return [g for g in goals if "says" in g and g["table"] == key]


# ---- the plots ---------------------------------------------------------------------------------------------------


def _goal_marks(goals: list[dict], column: str) -> dict[str, tuple[float, object]]:
    """row -> (where its goal line goes on `column`'s axis, its verdict); the tightest when a row has several."""
    marks: dict[str, tuple[float, object]] = {}
    for g in goals:
        if g["metric"] != column:
            continue
        at = g["limit"] if g["against"] is None else (
            g["limit"] * g["against_value"] if g["against_value"] is not None else None)
        if at is None:
            continue
        tighter = min if g["op"] == "<=" else max
        if g["row"] in marks:
            old_at, old_met = marks[g["row"]]
            at = tighter(at, old_at)
            met = False if False in (g["met"], old_met) else g["met"]
        else:
            met = g["met"]
        marks[g["row"]] = (at, met)
    return marks


def _bar_figure(plt, rows: dict[str, dict], columns: list[str], goals: list[dict]):
    names = list(rows)
    ncols = min(3, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.5, (0.4 * len(names) + 1.3) * nrows),
                             squeeze=False)
    for ax in axes.flat[len(columns):]:
        ax.set_visible(False)
    baselines = {g["against"] for g in goals if g["against"]}
    legend = {}
    for i, (ax, col) in enumerate(zip(axes.flat, columns)):
        marks = _goal_marks(goals, col)
        met = {g["row"]: g["met"] for g in goals if g["metric"] == col}
        vals = [rows[n].get(col, math.nan) for n in names]
        colours = []
        for n in names:
            if n in met:
                colours.append(COLOURS[marks.get(n, (None, met[n]))[1]])
            elif n in baselines:
                colours.append(COLOURS["baseline"])
            else:
                colours.append(COLOURS["other" if goals else None])
        bars = ax.barh(range(len(names)), vals, color=colours)
        for bar, n in zip(bars, names):
            if n in met:
                legend.setdefault({True: "goal met", False: "goal not met", None: "goal not measured"}[
                    marks.get(n, (None, met[n]))[1]], bar)
            elif n in baselines:
                legend.setdefault("baseline", bar)
        for n, (at, _) in marks.items():
            if n in names:
                y = names.index(n)
                line, = ax.plot([at, at], [y - 0.45, y + 0.45], color="black", lw=2)
                legend.setdefault("goal line", line)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names if i % ncols == 0 else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(col, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        positive = [v for v in vals + [at for at, _ in marks.values()] if _number(v) and v > 0]
        if len(positive) > 1 and max(positive) / min(positive) > 100:
            ax.set_xscale("log")
        ax.grid(True, axis="x", alpha=0.3)
    if legend:
        fig.legend(list(legend.values()), list(legend), fontsize=8, ncol=len(legend), loc="lower center",
                   bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def _split_figure(plt, rows: dict[str, dict]):
    names = [n for n, r in rows.items() if "ended.waits" in r]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.6))
    left = [0.0] * len(names)
    for phase, color in (("immediate", "#8c8c8c"), ("spin", "#dd8452"), ("yield", "#c4ad66"), ("park", "#4c72b0"),
                         ("timeout", "#937860")):
        vals = [100.0 * rows[n].get(f"ended.{phase}", 0.0) for n in names]
        ax.barh(range(len(names)), vals, left=left, label=phase, color=color)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of waits, by the phase they ended in")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def draw(results: dict, out_dir: str, goals: dict[str, list[dict]] | None = None
         ) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """Draws every plot into out_dir: ({benchmark: [(table key, caption, file name)]}, a note ('' when all went
    well)). `goals`: each benchmark's verdicts (verdicts()), drawn on their tables' plots."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "no plots: matplotlib is not installed (pip install 'hotloop[bench]')"
    drawn: dict[str, list[tuple[str, str, str]]] = {}
    for bench, data in results.items():
        for path, rows in find_tables(data):
            title = f"{bench}: {' / '.join(path) or 'results'}"
            key = path[0] if path else ""
            table_goals = [g for g in _table_goals((goals or {}).get(bench, []), path) if g["row"] in rows]
            columns = [c for c in dict.fromkeys(g["metric"] for g in table_goals) if any(c in r for r in rows.values())]
            columns = columns or _columns(rows)
            figures = []
            if columns:
                what = "; the goals' figures, a black line at each goal" if table_goals else ""
                figures.append((f"{title}{what}", _slug(bench, *path), _bar_figure(plt, rows, columns, table_goals)))
            if any("ended.waits" in r for r in rows.values()):
                figures.append((f"{title}: where waits ended", _slug(bench, *path, "ended"), _split_figure(plt, rows)))
            for caption, stem, fig in figures:
                name = stem + ".png"
                fig.savefig(os.path.join(out_dir, name), dpi=90, bbox_inches="tight")
                plt.close(fig)
                drawn.setdefault(bench, []).append((key, caption, name))
    return drawn, ""


# ---- the page ----------------------------------------------------------------------------------------------------


def _e(x) -> str:
    return html.escape(str(x))


NUMERIC = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+|-)\s?(x|%|k|[\d.]+-[\d.]+k)?$")


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td class='num'>{_e(c)}</td>" if i and NUMERIC.match(c.strip())
                                    else f"<td>{_e(c)}</td>" for i, c in enumerate(r)) + "</tr>" for r in t.rows)
    return f"<div class='box'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _word(v: dict) -> str:
    cls = {True: "met", False: "notmet", None: "unmeasured"}[v.get("met")]
    return f"<span class='{cls}'>{_e(verdict_word(v))}</span>"


def _goal_list(goals: list[dict], ids: dict[int, str]) -> str:
    items = []
    for g in goals:
        says, measured = verdict_text(g)
        items.append(f"<li id='{ids[id(g)]}'>{_word(g)} {_e(says)}: {_e(measured)}</li>")
    return f"<ul class='goals'>{''.join(items)}</ul>"


def _figures(figs) -> list[str]:
    return [f"<figure><img src='{_e(name)}' alt='{_e(caption)}'><figcaption>{_e(caption)}</figcaption></figure>"
            for _, caption, name in figs]


def _section(bench: str, text, goals: list[dict], figs: list, ids: dict[int, str]) -> tuple[str, dict[str, str]]:
    """A benchmark's section: each table with its goals and its plots under it, then the rest. Returns the html and
    {table key: anchor} for the tables that have one."""
    parts, anchors, left = [f"<h2 id='{_slug(bench)}'>{_e(bench)}</h2>"], {}, list(figs)
    shown_goals = set()
    if isinstance(text, list):  # report.Report
        for part in text:
            if isinstance(part, Table):
                anchor = _slug(bench, part.key) if part.key else ""
                if anchor:
                    anchors[part.key] = anchor
                id_attr = f" id='{anchor}'" if anchor else ""
                parts.append(f"<h3{id_attr}>{_e(part.title)}</h3>")
                parts.append(_html_table(part))
                if part.note:
                    parts.append(f"<p class='note'>{_e(part.note.strip())}</p>")
                mine = [g for g in goals if part.key and g.get("table") == part.key]
                if mine:
                    parts.append(_goal_list(mine, ids))
                    shown_goals.update(id(g) for g in mine)
                parts += _figures([f for f in left if part.key and f[0] == part.key])
                left = [f for f in left if not (part.key and f[0] == part.key)]
            else:
                parts.append(f"<p class='note'>{_e(str(part).strip())}</p>")
    else:
        parts.append(f"<div class='box'><pre>{_e(text)}</pre></div>")
    rest = [g for g in goals if id(g) not in shown_goals]
    if rest:
        parts.append(f"<h3>{_e(bench)}: goals</h3>" + _goal_list(rest, ids))
    parts += _figures(left)
    return "\n".join(parts), anchors


def _verdict(record: dict, goals: dict[str, list[dict]], ids: dict[int, str]) -> str:
    every = [(b, g) for b, gs in goals.items() for g in gs]
    met = sum(g.get("met") is True for _, g in every)
    missed = sum(g.get("met") is False for _, g in every)
    unmeasured = len(every) - met - missed
    counts = f"{met} of {len(every)} goals met" + (f", {missed} not met" if missed else "") + (
        f", {unmeasured} not measured" if unmeasured else "")
    out = [f"<h2 id='verdict'>Verdict: {_e(counts)}</h2>",
           "<p>Every goal the benchmarks state, judged on this run's figures: goals not met first, each linked to its "
           "table.</p>"]
    if record.get("quick"):
        out.append("<p>A short run (the default of <code>hotloop bench</code>): few repeats, on whatever else this "
                   "machine was doing. A goal it does not meet is not met in this run; <code>hotloop bench "
                   "--full</code> repeats each figure more before you conclude.</p>")
    rows = []
    for bench, g in sorted(every, key=lambda bg: {False: 0, None: 1, True: 2}[bg[1].get("met")]):  # misses first
        says, measured = verdict_text(g)
        rows.append(f"<tr><td>{_word(g)}</td><td>{_e(bench)}</td><td><a href='#{ids[id(g)]}'>{_e(says)}</a></td>"
                    f"<td>{_e(measured)}</td></tr>")
    if rows:
        out.append("<div class='box'><table class='verdict'><thead><tr><th>verdict</th><th>benchmark</th>"
                   "<th>goal</th><th>measured</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")
    none = [b for b, gs in goals.items() if not gs]
    if none:
        out.append(f"<p>No goal stated for: {_e(', '.join(none))} (figures side by side with their baselines, "
                   "below).</p>")
    return "\n".join(out)


def write(record: dict, texts: dict, out_dir: str,
          extra_images: dict[str, list[str]] | None = None) -> tuple[str, list[str]]:
    os.makedirs(out_dir, exist_ok=True)
    goals = verdicts(record)
    drawn, note = draw(record["results"], out_dir, goals)
    for bench, paths in (extra_images or {}).items():
        for p in paths:
            if os.path.exists(p):
                drawn.setdefault(bench, []).append(("", f"{bench}: {os.path.basename(p)}", os.path.relpath(p, out_dir)))
    ids = {id(g): f"goal-{_slug(b)}-{i + 1}" for b, gs in goals.items() for i, g in enumerate(gs)}
    sections = []
    for bench in dict.fromkeys([*texts, *record["results"]]):
        html_, _ = _section(bench, texts.get(bench, ""), goals.get(bench, []), drawn.get(bench, []), ids)
        sections.append(html_)
    info = record.get("info", {})
    run = "short run" if record.get("quick") else "full run"
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             f"<title>hotloop bench ({run})</title><style>{STYLE}</style></head><body>",
             f"<h1>hotloop bench ({run})</h1>",
             "<p>Each benchmark runs hotloop next to the loop it replaces, in the same run. Figures come from a "
             "shared machine unless said otherwise: compare rows of the same run, not runs.</p>",
             _verdict(record, goals, ids)]
    if note:
        parts.append(f"<p><b>{_e(note)}</b></p>")
    parts.append("<h2 id='contents'>Contents</h2><ul>" + "".join(
        f"<li><a href='#{_slug(b)}'>{_e(b)}</a></li>" for b in dict.fromkeys([*texts, *record["results"]]))
        + "<li><a href='#machine'>the machine</a></li></ul>")
    parts += sections
    parts.append("<h2 id='machine'>The machine</h2><div class='box'><table class='info'>" + "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in info.items()) + "</table></div>")
    parts.append("</body></html>")
    page = os.path.join(out_dir, "index.html")
    with open(page, "w") as f:
        f.write("\n".join(parts))
    images = [os.path.join(out_dir, name) for figs in drawn.values() for _, _, name in figs]
    return page, images
