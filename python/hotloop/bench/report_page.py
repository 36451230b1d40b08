"""The report page of ``hotloop bench``: one HTML page with every benchmark's tables and plots, PNGs next to it.

Contract: ``write(record, texts, out_dir, extra_images)`` writes ``out_dir/index.html`` and one PNG per plot,
and returns ``(page path, [PNG paths])``. ``record`` is the JSON record of the run (``{"info", "quick",
"results": {name: data}}``), ``texts`` each benchmark's printed tables, ``extra_images`` PNGs a benchmark drew
itself ({name: [path]}, e.g. the engine's latency distributions). Plots are found in the data, so a benchmark
needs no plotting code of its own: every table-like part of its results (rows of numbers that share columns,
or one dict of numbers; see find_tables) gets one figure of bar charts (one subplot per column, up to six),
and rows that record where waits ended (an ``"ended"`` split, from hotloop.metrics) also get a stacked
spin / yield / park bar. Without matplotlib the page still holds every table and says how to get the plots.
"""

from __future__ import annotations

import html
import math
import os
import re

MAX_COLUMNS = 6  # subplots per figure
SKIPPED = re.compile(r"(_spread|_runs|^n$|\.n$|wall_s)")


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


def _bar_figure(plt, title: str, rows: dict[str, dict], columns: list[str]):
    names = list(rows)
    ncols = min(3, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.5, (0.4 * len(names) + 1.2) * nrows),
                             squeeze=False)
    for ax in axes.flat[len(columns):]:
        ax.set_visible(False)
    for i, (ax, col) in enumerate(zip(axes.flat, columns)):
        vals = [rows[n].get(col, math.nan) for n in names]
        ax.barh(range(len(names)), vals, color="#4c72b0")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names if i % ncols == 0 else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(col, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        positive = [v for v in vals if _number(v) and v > 0]
        if len(positive) > 1 and max(positive) / min(positive) > 100:
            ax.set_xscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _split_figure(plt, title: str, rows: dict[str, dict]):
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
    ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(title, fontsize=10, y=1.08)
    fig.tight_layout()
    return fig


def draw(results: dict, out_dir: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """Draws every plot into out_dir: ({benchmark: [(caption, file name)]}, a note ('' when all went well))."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "no plots: matplotlib is not installed (pip install 'hotloop[bench]')"
    drawn: dict[str, list[tuple[str, str]]] = {}
    for bench, data in results.items():
        for path, rows in find_tables(data):
            title = f"{bench}: {' / '.join(path) or 'results'}"
            figures = []
            columns = _columns(rows)
            if columns:
                figures.append((title, _slug(bench, *path), _bar_figure(plt, title, rows, columns)))
            if any("ended.waits" in r for r in rows.values()):
                figures.append((title + " (where waits ended)", _slug(bench, *path, "ended"),
                                _split_figure(plt, title + ": where waits ended", rows)))
            for caption, stem, fig in figures:
                name = stem + ".png"
                fig.savefig(os.path.join(out_dir, name), dpi=90, bbox_inches="tight")
                plt.close(fig)
                drawn.setdefault(bench, []).append((caption, name))
    return drawn, ""


def write(record: dict, texts: dict[str, str], out_dir: str,
          extra_images: dict[str, list[str]] | None = None) -> tuple[str, list[str]]:
    os.makedirs(out_dir, exist_ok=True)
    drawn, note = draw(record["results"], out_dir)
    for bench, paths in (extra_images or {}).items():
        for p in paths:
            if os.path.exists(p):
                drawn.setdefault(bench, []).append((os.path.basename(p), os.path.relpath(p, out_dir)))
    info = record.get("info", {})
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>hotloop bench</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}pre{background:#f6f6f6;"
             "padding:1em;overflow-x:auto;font-size:12px}img{max-width:100%;display:block;margin:1em 0}"
             "td{padding:0 1em}</style></head><body>",
             f"<h1>hotloop bench ({'short run' if record.get('quick') else 'full run'})</h1>",
             "<table>" + "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                                 for k, v in info.items()) + "</table>",
             "<p>Figures come from a shared machine unless said otherwise: compare rows of the same run, not runs.</p>"]
    if note:
        parts.append(f"<p><b>{html.escape(note)}</b></p>")
    parts.append("<ul>" + "".join(f"<li><a href='#{_slug(b)}'>{html.escape(b)}</a></li>" for b in texts) + "</ul>")
    for bench, text in texts.items():
        parts.append(f"<h2 id='{_slug(bench)}'>{html.escape(bench)}</h2><pre>{html.escape(text)}</pre>")
        for caption, name in drawn.get(bench, []):
            parts.append(f"<figure><img src='{html.escape(name)}' alt='{html.escape(caption)}'>"
                         f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    page = os.path.join(out_dir, "index.html")
    with open(page, "w") as f:
        f.write("\n".join(parts))
    images = [os.path.join(out_dir, name) for pairs in drawn.values() for _, name in pairs]
    return page, images
