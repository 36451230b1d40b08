"""The soak's report: what the loads and the chaos counted, as a table and a JSON record.

Contract:

- ``Report`` is a ``Findings`` (``findings.py``): loads call ``count`` and ``finding`` while the run goes on, chaos appends its
  ``Kill``s to ``kills``. Only the driver imports this module; it imports the loads, never the other way round.
- ``build`` turns the run into a record: rows ``(section, name, value, must_be_zero)``, the kill-to-error
  percentiles per kind against the goal, the leaks, and ``ok`` (every must-be-0 row is 0, and the goal is met or
  not failed on). ``render`` formats a record as the table printed on stdout.
- With ``--network`` (``net`` given: the ``NetFault``s and the partition bound), a section per fault kind:
  injected, detected (a partition: DeadPeerError in the writer and in the cut-off reader; any other kind must
  raise nothing), detected after the bound, errors, lost / duplicated / out of order / hung, and the segments,
  processes and descriptors its generations left; and the fault-to-error percentiles per kind and side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hotloop.soak.findings import Findings
from hotloop.soak.net_fault import KINDS, PARTITION
from hotloop.soak.own_processes import percentiles

if TYPE_CHECKING:
    from hotloop.soak.chaos import Chaos
    from hotloop.soak.queue_load import QueueGroup
    from hotloop.soak.request_load import EngineLoad, OrchestratorLoad

MUST_BE_ZERO = "must be 0"


class Report(Findings):
    def build(self, cfg: dict, groups: list[QueueGroup], engine: EngineLoad, orch: OrchestratorLoad, chaos: Chaos,
              leaks: dict, goal_s: float, fail_on_goal: bool, net: dict | None = None) -> dict:
        rows = []  # (section, name, value, must_be_zero)

        def row(section, name, value, zero=False):
            rows.append({"section": section, "name": name, "value": value, "must_be_zero": zero})

        self._queue_rows(row, groups)
        self._load_rows(row, engine, orch)
        for what, n in sorted(chaos.actions.items()):
            row("chaos", what, n)
        by_kind: dict[str, list[float]] = {}
        unobserved = 0
        for k in self.kills:
            if k.detected_s:
                by_kind.setdefault(k.kind, []).extend(k.detected_s)
            else:
                unobserved += 1
        all_s = [x for xs in by_kind.values() for x in xs]
        latency = {kind: percentiles(xs) for kind, xs in sorted(by_kind.items())}
        latency["all"] = percentiles(all_s)
        row("kill to error", "kills with no survivor error observed", unobserved)
        row("leaks", "/dev/shm/hotloop-* entries", len(leaks["shm"]), True)
        row("leaks", "/dev/shm/hotloop-* of other programs (not counted)", len(leaks["shm_of_other_programs"]))
        row("leaks", "child processes", len(leaks["children"]), True)
        row("leaks", "file descriptors", len(leaks["fds"]), True)
        row("leaks", "threads (informational)", len(leaks["threads"]))
        fault_latency = self._network_rows(row, net) if net is not None else {}
        zero_fail = [r for r in rows if r["must_be_zero"] and r["value"]]
        worst = latency["all"]["max"]
        goal_missed = worst is not None and worst > goal_s
        ok = not zero_fail and not (goal_missed and fail_on_goal)
        return {"config": cfg, "rows": rows, "kill_to_error_s": latency, "goal_s": goal_s, "goal_missed": goal_missed,
                "fail_on_goal": fail_on_goal, "failed_rows": [f"{r['section']}: {r['name']}" for r in zero_fail],
                "kills": [{"kind": k.kind, "label": k.label, "pid": k.pid, "detected_s": k.detected_s,
                           "note": k.note} for k in self.kills],
                "findings": self.findings, "leaks": leaks, "ok": ok,
                "engine": engine.tally.as_dict(), "orchestrator": orch.tally.as_dict(),
                **({} if net is None else {
                    "network_fault_to_error_s": fault_latency, "network_bound_s": net["bound_s"],
                    "network_faults": [{k: v for k, v in f.__dict__.items() if k != "pids"} for f in net["faults"]]})}

    def _queue_rows(self, row, groups: list[QueueGroup]) -> None:
        """The rows of every queue reader, then the queues' totals."""
        for g in groups:
            for rank, t in g.totals.items():
                sec = f"queue q{g.wid} reader r{rank} ({g.rank_kind(rank).removeprefix('queue ')})"
                row(sec, "generations survived", t.generations)
                row(sec, "messages sent", t.sent)
                row(sec, "messages received", t.received)
                row(sec, "lost", t.lost, True)
                row(sec, "duplicated", t.dup, True)
                row(sec, "out of order", t.ooo, True)
                row(sec, "corrupt or foreign", t.bad, True)
                if rank >= g.n_local:
                    row(sec, "in flight when its writer was killed (documented)", t.inflight_at_writer_kill)
                    row(sec, "in flight when its node's relay stopped (documented)", t.inflight_at_relay_kill)
                if rank >= g.n_local and g.nodes is not None:
                    row(sec, "sent after its node was cut off (never delivered)", t.cut_off_tail)
        row("queue", "generations", sum(g.generations for g in groups))
        row("queue", "messages sent (all writers)", sum(g.sent for g in groups))
        row("queue", "unexpected errors", self.counts.get("queue unexpected errors", 0), True)
        row("queue", "start failures", self.counts.get("queue start failures", 0), True)
        row("queue", "processes hung", self.counts.get("queue processes hung", 0), True)

    def _load_rows(self, row, engine: EngineLoad, orch: OrchestratorLoad) -> None:
        """The rows of the engine's and the orchestrator's request loads."""
        for label, load in (("engine", engine), ("orchestrator", orch)):
            t = load.tally
            row(label, "good requests finished", t.good_finished)
            row(label, "requests failed by a kill (clear error)", t.good_failed_by_kill + t.bad_failed_by_kill)
            row(label, "bad requests rejected (clear error)", sum(t.bad_rejected.values()))
            row(label, "bad requests served", t.bad_served)
            row(label, "requests hung", t.hung, True)
            row(label, "good requests failed, no kill", t.good_failed_unexpected, True)
            row(label, "bad requests, unclear outcome", t.bad_unexpected, True)
            row(label, "deaths no kill explains", t.deaths_unexplained, True)
            row(label, "restarts", t.restarts)
            row(label, "start failures", self.counts.get(f"{label} start failures", 0), True)
        row("orchestrator", "evictions", getattr(orch.tally, "evictions", 0))
        row("orchestrator", "request entries left", self.counts.get("orchestrator request entries left", 0), True)

    @staticmethod
    def _network_rows(row, net: dict) -> dict:
        """The rows of each network fault kind; returns the fault-to-error percentiles per kind and side."""
        bound = net["bound_s"]
        latency = {}
        for kind in KINDS:
            faults = [f for f in net["faults"] if f.kind == kind]
            sec = f"network: {kind}"
            row(sec, "injected", len(faults))
            if kind == PARTITION:
                both = [f for f in faults if {"writer", "reader"} <= f.detected_s.keys()]
                row(sec, "detected (DeadPeerError in the writer and the reader)", len(both))
                row(sec, "not detected at both ends", len(faults) - len(both), True)
                row(sec, f"detected after the bound ({bound:g} s)",
                    sum(1 for f in faults if any(s > bound for s in f.detected_s.values())), True)
                for side in ("writer", "reader"):
                    latency[f"{kind}: {side}"] = percentiles([f.detected_s[side] for f in faults
                                                              if side in f.detected_s])
            else:
                row(sec, "detected (raised an error)", sum(1 for f in faults if f.detected_s or f.errors), True)
                # A short cut must end within TCP's retransmissions before the peer timeout (sent + 0.2, 0.6, 1.4 s
                # at the minimum RTO; the next, at 3.0 s, is past a 3 s timeout): one that lasted longer is a
                # partition to the connection, whatever was planned. This row shows how long the longest lasted.
                row(sec, "longest, injecting to healed (s)", round(max((f.lasted_s for f in faults), default=0), 2))
            row(sec, "errors", sum(len(f.errors) for f in faults), True)
            row(sec, "lost", sum(f.lost for f in faults), True)
            row(sec, "duplicated", sum(f.dup for f in faults), True)
            row(sec, "out of order", sum(f.ooo for f in faults), True)
            row(sec, "processes hung", sum(f.hung for f in faults), True)
            row(sec, "leaked segments", sum(f.leaked_segments for f in faults), True)
            row(sec, "leaked processes", sum(f.leaked_processes for f in faults), True)
            row(sec, "descriptors left open after close()", sum(f.fds_left for f in faults), True)
        return latency

    @staticmethod
    def render(rec: dict) -> str:
        lines = [f"hotloop soak: {rec['config']['minutes']} min, seed {rec['config']['seed']}"]
        loss = rec["config"].get("sustained_loss_percent")
        if loss:
            lines[0] += f"; every reader node losing {loss} % of its packets each way"
        if rec["config"].get("delay_proxy") is False:
            lines[0] += "; every remote reader connected straight (no delay proxy, no delay faults)"
        section = None
        for r in rec["rows"]:
            if r["section"] != section:
                section = r["section"]
                lines.append(f"\n{section}")
            flag = ""
            if r["must_be_zero"]:
                flag = MUST_BE_ZERO if not r["value"] else f"{MUST_BE_ZERO}  <-- FAIL"
            lines.append(f"  {r['name']:<52} {r['value']:>10}  {flag}")
        lines.append(f"\nkill to error (s){'':<36}{'n':>4} {'p50':>8} {'p99':>8} {'max':>8}")

        def f(x):
            return "-" if x is None else f"{x:.3f}"

        for kind, p in rec["kill_to_error_s"].items():
            lines.append(f"  {kind:<50} {p['n']:>4} {f(p['p50']):>8} {f(p['p99']):>8} {f(p['max']):>8}")
        goal = rec["goal_s"]
        verdict = "missed" if rec["goal_missed"] else "met"
        lines.append(f"  goal: max <= {goal:g} s: {verdict}{'' if rec['fail_on_goal'] else ' (reported, not failed on)'}")
        if "network_fault_to_error_s" in rec:
            lines.append(f"\nnetwork fault to DeadPeerError (s){'':<19}{'n':>4} {'p50':>8} {'p99':>8} {'max':>8}")
            for kind, p in rec["network_fault_to_error_s"].items():
                lines.append(f"  {kind:<50} {p['n']:>4} {f(p['p50']):>8} {f(p['p99']):>8} {f(p['max']):>8}")
            lines.append(f"  bound: max <= {rec['network_bound_s']:g} s (HOTLOOP_PEER_TIMEOUT_S + slack); the other "
                         f"kinds raise nothing")
        if rec["findings"]:
            uniq = list(dict.fromkeys(f"[{x['area']}] {x['what']}" for x in rec["findings"]))
            lines.append(f"\nfindings ({len(rec['findings'])}, {len(uniq)} distinct):")
            lines += [f"  - {u}" for u in uniq[:40]]
            if len(uniq) > 40:
                lines.append(f"  ... {len(uniq) - 40} more in the JSON record")
        lines.append(f"\nresult: {'PASS' if rec['ok'] else 'FAIL'}"
                     + ("" if rec["ok"] else f" ({', '.join(rec['failed_rows']) or 'kill-to-error goal'})"))
        return "\n".join(lines)
