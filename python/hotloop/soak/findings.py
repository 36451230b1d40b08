"""What the soak's loads and chaos record while the run goes on: the kills, the counts and the findings.

Contract:

- Chaos appends each SIGKILL to ``kills`` as a ``Kill``; the load that owns the process fills in ``detected_s``
  when its survivors raise their errors.
- Loads call ``count`` and ``finding`` (each distinct finding is logged once on stderr).
- Nothing here reads the record back: ``report.Report`` (a ``Findings``) turns it into the table and the JSON
  record after the run. This module imports no other part of the soak but ``own_processes``, so every load can
  import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hotloop.soak.own_processes import log


@dataclass
class Kill:
    """One chaos SIGKILL and when (monotonic clock, shared by every process on the machine) survivors noticed."""

    kind: str  # "queue writer", "queue local reader", "queue remote reader", "engine", "engine worker", "replica"
    label: str
    pid: int
    t: float
    detected_s: list[float] = field(default_factory=list)  # one per survivor that raised its error
    note: str = ""


class Findings:
    def __init__(self):
        self.kills: list[Kill] = []
        self.counts: dict[str, int] = {}
        self.findings: list[dict] = []

    def count(self, what: str, n: int = 1):
        self.counts[what] = self.counts.get(what, 0) + n

    def finding(self, area: str, what: str, zero: bool = False):
        self.findings.append({"area": area, "what": what, "t": time.monotonic()})
        if len([f for f in self.findings if f["what"] == what]) == 1:
            log(f"FINDING [{area}] {what}")
