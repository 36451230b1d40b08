"""Loads an HTML page in headless Chromium (Debian's ``chromium``) at a laptop's window size and lists what is
wrong with it: an image that did not load (naturalWidth 0), a script error, the page wider than the window, an
element (a table, a figure) that reaches past the window's right edge, or preformatted text that runs past its
box (text tables read through a sideways scroll bar).

How: the page's folder is copied (its images travel with it), a small script is put first in the copy's <head>
(it records errors from then on and, once the page has loaded, writes what it found into the DOM), and
``chromium --headless --dump-dom`` prints the DOM after load. No browser driver library is needed.

``problems(page) -> [str]`` for tests (tests/test_bench_report.py); ``python tests/page_check.py PAGE`` for
scripts/test.sh (exit status 1 and the list when anything is wrong).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

WIDTH, HEIGHT = 1280, 800  # a laptop's screen

PROBE = """<script>
window.__problems = [];
window.addEventListener("error", function (e) {
  var t = e.target;
  if (t && t !== window && t.tagName) {
    window.__problems.push("failed to load <" + t.tagName.toLowerCase() + "> " + (t.src || t.href || ""));
  } else {
    window.__problems.push("script error: " + e.message + " (" + e.filename + ":" + e.lineno + ")");
  }
}, true);
window.addEventListener("unhandledrejection", function (e) {
  window.__problems.push("script error: unhandled rejection " + e.reason);
});
window.addEventListener("load", function () {
  var p = window.__problems, doc = document.documentElement, width = doc.clientWidth;
  document.querySelectorAll("img").forEach(function (img) {
    if (!img.complete || img.naturalWidth === 0) p.push("missing image: " + img.getAttribute("src"));
  });
  if (doc.scrollWidth > width) p.push("page wider than the window: " + doc.scrollWidth + " px > " + width + " px");
  var wide = [];
  document.body.querySelectorAll("*").forEach(function (el) {
    var r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > width + 1) {
      var inside = el.parentElement && el.parentElement.closest("[data-too-wide]");
      if (!inside) {
        el.setAttribute("data-too-wide", "");
        wide.push("<" + el.tagName.toLowerCase() + (el.id ? " id=" + el.id : "") + "> ends at " +
                  Math.round(r.right) + " px, past the window (" + width + " px): " +
                  (el.textContent || el.getAttribute("src") || "").trim().slice(0, 80));
      }
    }
  });
  wide.forEach(function (w) { p.push("too wide: " + w); });
  document.querySelectorAll("pre").forEach(function (el) {
    if (el.scrollWidth > el.clientWidth + 1) {
      p.push("preformatted text runs past its box (" + el.scrollWidth + " px in " + el.clientWidth + " px): " +
             el.textContent.trim().slice(0, 80));
    }
  });
  var out = document.createElement("pre");
  out.id = "page-check-result";
  out.textContent = JSON.stringify(p);
  document.body.appendChild(out);
});
</script>"""


def chromium() -> str | None:
    """The Chromium binary, or None when it is not installed (apt-get install chromium)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def problems(page: str, timeout: float = 60.0) -> list[str]:
    """What is wrong with `page` (an HTML file; its images relative to it) in headless Chromium; [] when nothing."""
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="page-check-") as tmp:
        copy = os.path.join(tmp, "page")
        shutil.copytree(os.path.dirname(os.path.abspath(page)), copy)
        path = os.path.join(copy, os.path.basename(page))
        with open(path) as f:
            text = f.read()
        head = re.search(r"<head[^>]*>", text, re.I)
        at = head.end() if head else 0
        with open(path, "w") as f:
            f.write(text[:at] + PROBE + text[at:])
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               "--disable-dev-shm-usage", f"--user-data-dir={os.path.join(tmp, 'profile')}",
               f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=10000", "--dump-dom",
               "file://" + path]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    found = re.search(r'<pre id="page-check-result">(.*?)</pre>', done.stdout, re.S)
    if not found:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        return [f"chromium did not finish loading the page (exit status {done.returncode}): {tail}"]
    return json.loads(html.unescape(found.group(1)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} PAGE.html")
    found = problems(sys.argv[1])
    for p in found:
        print(f"{sys.argv[1]}: {p}")
    print(f"{sys.argv[1]}: {'%d problem(s)' % len(found) if found else 'loads cleanly'} in headless Chromium at "
          f"{WIDTH}x{HEIGHT}")
    sys.exit(1 if found else 0)
