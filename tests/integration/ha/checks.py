"""What the acceptance harness computes after a run (docs/ha.md, "Acceptance"),
from the servers' ownership traces (controlplane/ha/trace.py), the load
generator's records (loadgen.py), the fault events (procs.py) and the
ledger. Pure functions over those records: the CI test asserts some of
them, bench/ha_acceptance.py reports all of them.

Every time is ``time.monotonic_ns()`` of one host.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from tests.integration.ha.procs import Event, pg_dsn

HOUR_NS = 3600 * 10**9


# ------------------------------------------------------------ the traces


@dataclass(frozen=True)
class Validity:
    """One lease's validity interval in one process: [start_ns, end_ns)."""

    member: str
    pid: int
    cell: str
    epoch: int
    start_ns: int
    end_ns: int
    how: str  # the end line's why; "deadline" (no end line); "killed" (cut at the kill)


@dataclass
class Trace:
    intervals: list[Validity] = field(default_factory=list)
    # cell -> sorted (epoch, first moment it was the database's epoch as seen here)
    epoch_starts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    writes: list[dict[str, Any]] = field(default_factory=list)  # landed window writes
    refused: list[dict[str, Any]] = field(default_factory=list)

    def of_cell(self, cell: str) -> list[Validity]:
        return sorted((v for v in self.intervals if v.cell == cell), key=lambda v: v.start_ns)

    def holding(self, cell: str, member: str, at_ns: int) -> bool:
        return any(
            v.cell == cell and v.member == member and v.start_ns <= at_ns < v.end_ns
            for v in self.intervals
        )

    def cells_of(self, member: str, at_ns: int) -> set[str]:
        return {
            v.cell for v in self.intervals if v.member == member and v.start_ns <= at_ns < v.end_ns
        }


def read_traces(paths: Iterable[Path], deaths: dict[int, int] | None = None) -> Trace:
    """The intervals of every trace file. An interval without an end line
    ends at its last deadline (a killed or stopped process), or at the
    process's death when that came first."""
    deaths = deaths or {}
    opened: dict[tuple[int, str, int], dict[str, Any]] = {}
    out = Trace()
    starts: dict[str, dict[int, int]] = defaultdict(dict)
    for path in paths:
        for raw in path.read_text().splitlines():
            if not raw.strip():
                continue
            line = json.loads(raw)
            ev = line["ev"]
            if ev in ("window_write", "window_refused"):
                (out.writes if ev == "window_write" else out.refused).append(line)
                continue
            key = (line["pid"], line["cell"], line["epoch"])
            if ev == "start":
                opened[key] = dict(line)
                prev = starts[line["cell"]].get(line["epoch"])
                starts[line["cell"]][line["epoch"]] = min(
                    line["start_ns"], prev or line["start_ns"]
                )
            elif ev == "unused":
                prev = starts[line["cell"]].get(line["epoch"])
                starts[line["cell"]][line["epoch"]] = min(line["at_ns"], prev or line["at_ns"])
            elif ev == "renew" and key in opened:
                opened[key]["deadline_ns"] = line["deadline_ns"]  # the latest is in force
            elif ev == "end" and key in opened:
                s = opened.pop(key)
                out.intervals.append(
                    Validity(
                        s["member"],
                        s["pid"],
                        s["cell"],
                        s["epoch"],
                        s["start_ns"],
                        line["end_ns"],
                        line["why"],
                    )
                )
    for (pid, cell, epoch), s in opened.items():
        end, how = s["deadline_ns"], "deadline"
        died = deaths.get(pid)
        if died is not None and died < end:
            end, how = died, "killed"
        out.intervals.append(Validity(s["member"], pid, cell, epoch, s["start_ns"], end, how))
    out.epoch_starts = {c: sorted(e.items()) for c, e in starts.items()}
    return out


def overlaps(trace: Trace) -> list[tuple[Validity, Validity]]:
    """Pairs of intervals of one cell that overlap (two owners at once)."""
    found = []
    by_cell: dict[str, list[Validity]] = defaultdict(list)
    for v in trace.intervals:
        by_cell[v.cell].append(v)
    for items in by_cell.values():
        items.sort(key=lambda v: v.start_ns)
        latest: Validity | None = None  # the interval reaching furthest so far
        for v in items:
            if latest is not None and v.start_ns < latest.end_ns:
                found.append((latest, v))
            if latest is None or v.end_ns > latest.end_ns:
                latest = v
    return found


def epoch_disorder(trace: Trace) -> list[tuple[Validity, Validity]]:
    """Consecutive intervals of a cell whose epochs do not rise with time."""
    bad = []
    for cell in {v.cell for v in trace.intervals}:
        items = trace.of_cell(cell)
        bad += [(a, b) for a, b in itertools.pairwise(items) if b.epoch <= a.epoch]
    return bad


def stale_writes(trace: Trace) -> tuple[list[dict[str, Any]], int]:
    """Landed window writes of epoch e that began once a later epoch of the
    cell was already valid (the fence should have refused them: its read
    comes after ``begin_ns``), and how many more only *ended* after that
    (not provably stale: the commit may precede the takeover, which waits
    for it)."""
    stale, ambiguous = [], 0
    for w in trace.writes:
        later = [at for epoch, at in trace.epoch_starts.get(w["cell"], []) if epoch > w["epoch"]]
        if not later:
            continue
        nxt = min(later)
        if w["begin_ns"] >= nxt:
            stale.append(w)
        elif w["done_ns"] > nxt:
            ambiguous += 1
    return stale, ambiguous


# ------------------------------------------------------- load records


@dataclass(frozen=True, slots=True)
class Admit:
    sent: int
    got: int
    tenant: str
    rid: str
    pool: str
    outcome: str  # A admitted, R refused, N not owner, O offline (SDK)
    reason: str
    replica: str
    reserved: int

    @property
    def decided(self) -> bool:
        return self.outcome in ("A", "R")


@dataclass(frozen=True, slots=True)
class Done:
    sent: int
    got: int
    tenant: str
    rid: str
    prompt: int
    generated: int
    delivered: bool
    duplicate: bool
    error: str


def read_admits(path: Path) -> list[Admit]:
    with path.open() as f:
        return [
            Admit(int(r[0]), int(r[1]), r[2], r[3], r[4], r[5], r[6], r[7], int(r[8]))
            for r in csv.reader(f)
        ]


def read_completes(path: Path) -> list[Done]:
    with path.open() as f:
        return [
            Done(
                int(r[0]),
                int(r[1]),
                r[2],
                r[3],
                int(r[4]),
                int(r[5]),
                r[6] == "1",
                r[7] == "1",
                r[8],
            )
            for r in csv.reader(f)
        ]


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


# ------------------------------------------------------------- ledger


def reconcile(url: str, completes: Sequence[Done], run_ids: Sequence[str]) -> dict[str, Any]:
    """Every Complete a server acknowledged must be in ``ledger_records``
    exactly once, with the tokens sent; those the SDK buffered (delivered
    later by its spool) are checked the same way and counted apart."""
    ledger: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    with psycopg.connect(pg_dsn(url)) as c:
        for prefix in run_ids:
            rows = c.execute(
                "SELECT tenant_id, request_id, prompt_tokens, output_tokens FROM ledger_records "
                "WHERE request_id LIKE %s",
                (prefix + "-%",),
            )
            for t, r, p, o in rows:
                ledger[(t, r)].append((p, o))
    acked = [d for d in completes if d.delivered and not d.error]
    buffered = [d for d in completes if not d.delivered and not d.error]
    out: dict[str, Any] = {"acknowledged": len(acked), "buffered": len(buffered)}
    for name, items in (("", acked), ("buffered_", buffered)):
        lost = [d for d in items if not ledger.get((d.tenant, d.rid))]
        dup = [d for d in items if len(ledger.get((d.tenant, d.rid), ())) > 1]
        wrong = [
            d
            for d in items
            if len(ledger.get((d.tenant, d.rid), ())) == 1
            and ledger[(d.tenant, d.rid)][0] != (d.prompt, d.generated)
        ]
        out[f"{name}lost"] = len(lost)
        out[f"{name}duplicated"] = len(dup)
        out[f"{name}tokens_wrong"] = len(wrong)
        out[f"{name}samples"] = [f"{d.tenant}/{d.rid}" for d in (lost + dup + wrong)[:10]]
    completed = {(d.tenant, d.rid) for d in completes}
    out["ledger_rows"] = sum(len(v) for v in ledger.values())
    # settled by the SDK itself (late admissions released with no usage)
    out["ledger_not_completed_by_load"] = sum(1 for k in ledger if k not in completed)
    out["complete_errors"] = sum(1 for d in completes if d.error)
    return out


def quota_overshoot(url: str, tenant: str, hourly_quota: int) -> dict[str, Any]:
    """Tokens (prompt + output, by settlement hour) the ledger holds for
    ``tenant`` beyond its hourly quota, per UTC hour; 0 is the target."""
    with psycopg.connect(pg_dsn(url)) as c:
        rows = c.execute(
            "SELECT settled_ns / %s AS h, sum(prompt_tokens + output_tokens) FROM ledger_records "
            "WHERE tenant_id = %s GROUP BY h ORDER BY h",
            (HOUR_NS, tenant),
        ).fetchall()
    per_hour = {int(h): int(n) for h, n in rows}
    return {
        "quota": hourly_quota,
        "per_hour": list(per_hour.values()),
        "overshoot": max([n - hourly_quota for n in per_hour.values()] + [0]),
        "exhausted": any(n >= 0.9 * hourly_quota for n in per_hour.values()),
    }


# ---------------------------------------------------------- ownership


def failover_times(
    events: Sequence[Event], kinds: Sequence[str], admits: Sequence[Admit], trace: Trace,
    cell_of: dict[str, str], member_of: dict[str, str],
) -> list[dict[str, Any]]:  # fmt: skip
    """Per fault of ``kinds`` and per cell the victim held then, seconds from
    the fault to:

    - ``load_s``: the first *admission* of that cell, of a request sent
      after the fault, by a replica holding a lease of the cell that began
      after the fault: service back under a new lease (the load's view; an
      admission names its replica, a refusal does not; a victim still
      running (SIGTERM's flush, a cut link) decides under its old lease
      until it ends, and a victim back from SIGSTOP may be the new holder);
    - ``trace_s``: the first validity interval of the cell that another
      member starts after the fault (the traces' view);
    - ``released_s``: the end of the victim's own interval (its release on
      SIGTERM, its self-fencing deadline otherwise), so ``trace_s -
      released_s`` is the gap with no owner."""
    by_cell: dict[str, list[Admit]] = defaultdict(list)
    for a in admits:
        if a.outcome == "A" and a.replica and a.pool in cell_of:
            by_cell[cell_of[a.pool]].append(a)
    for items in by_cell.values():
        items.sort(key=lambda a: a.sent)
    out = []
    for ev in events:
        if ev.what not in kinds:
            continue
        for cell in sorted(trace.cells_of(ev.member, ev.at_ns)):
            items = by_cell.get(cell, [])
            i = bisect.bisect_right([a.sent for a in items], ev.at_ns)
            later = [v for v in trace.of_cell(cell) if v.start_ns > ev.at_ns]
            first: int | None = None
            for a in items[i:]:  # by send time: stop once no later send can answer sooner
                if first is not None and a.sent > first:
                    break
                m = member_of.get(a.replica)
                if any(v.member == m and v.start_ns <= a.got for v in later):
                    first = a.got if first is None else min(first, a.got)
            owner = next((v for v in later if v.member != ev.member), None)
            mine = [
                v for v in trace.of_cell(cell)
                if v.member == ev.member and v.start_ns <= ev.at_ns < v.end_ns
            ]  # fmt: skip
            out.append({
                "what": ev.what, "member": ev.member, "cell": cell,
                "load_s": None if first is None else (first - ev.at_ns) / 1e9,
                "trace_s": None if owner is None else (owner.start_ns - ev.at_ns) / 1e9,
                "released_s": (mine[0].end_ns - ev.at_ns) / 1e9 if mine else None,
                "new_owner": owner.member if owner else "",
            })  # fmt: skip
    return out


def decided_outside_lease(
    admits: Sequence[Admit], trace: Trace, cell_of: dict[str, str], member_of: dict[str, str]
) -> list[Admit]:
    """Admissions whose admitting replica held no lease of the pool's cell
    at any moment between the request's send and its answer."""
    spans: dict[tuple[str, str], list[Validity]] = defaultdict(list)
    for v in trace.intervals:
        spans[(v.member, v.cell)].append(v)
    bad = []
    for a in admits:
        if a.outcome != "A" or not a.replica or a.pool not in cell_of:
            continue
        member = member_of.get(a.replica, "")
        vs = spans.get((member, cell_of[a.pool]), [])
        if not any(v.start_ns <= a.got and v.end_ns >= a.sent for v in vs):
            bad.append(a)
    return bad


# ------------------------------------------------ reported-only figures


def spread_figure(
    admits: Sequence[Admit], tenant: str, rate: float, burst: int, start_ns: int,
    seconds: float = 60.0,
) -> dict[str, Any]:  # fmt: skip
    """A tenant spread over several cells at twice its limit: tokens admitted
    in ``seconds`` from ``start_ns`` against the single-owner bounds
    (the acceptance table: <= rate x t + burst, >= 0.9 x rate x t)."""
    end = start_ns + int(seconds * 1e9)
    admitted = sum(a.reserved for a in admits if a.tenant == tenant and a.outcome == "A"
                   and start_ns <= a.got < end)  # fmt: skip
    offered = sum(a.reserved for a in admits if a.tenant == tenant and start_ns <= a.sent < end)
    upper, lower = rate * seconds + burst, 0.9 * rate * seconds
    return {
        "seconds": seconds, "admitted_tokens": admitted, "offered_tokens": offered,
        "upper": upper, "lower": lower, "ratio_to_limit": admitted / (rate * seconds),
    }  # fmt: skip


def spread_within_limit(fig: dict[str, Any]) -> bool:
    """The acceptance row "a tenant spread over 4 cells": what the lead
    switches to asserting once the service uses per-member grants
    (controlplane/domain/shares.py); today each owner gives the tenant its whole
    rate, so this is False (reported, not asserted)."""
    return bool(fig["lower"] <= fig["admitted_tokens"] <= fig["upper"])


def gate_figures(
    admits: Sequence[Admit], completes: Sequence[Done], tenant: str, limit: int,
    events: Sequence[Event], trace: Trace, cell: str, member_of: dict[str, str], end_ns: int,
) -> dict[str, Any]:  # fmt: skip
    """A tenant capped at ``limit`` requests in flight, in one cell, whose
    requests outlive a failover. Reported:

    - ``peak``: the most of its requests in flight at once (admitted, the
      Complete not yet sent: the load's view), against ``limit``;
    - per takeover of its cell after a kill: ``restored`` = the share of the
      old owner's open reservations the new owner's gate evidently counted:
      min over time of (limit - new owner's in flight) / old ones still
      open, clipped to [0, 1] (1.0: it never admitted into their room)."""
    done_at = {(d.tenant, d.rid): d.sent for d in completes}
    spans = []
    for a in admits:
        if a.tenant == tenant and a.outcome == "A":
            spans.append(
                (a.got, done_at.get((a.tenant, a.rid), end_ns), member_of.get(a.replica, ""))
            )
    edges = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    takeovers = []
    for ev in events:
        if ev.what != "kill" or not trace.holding(cell, ev.member, ev.at_ns):
            continue
        old = [(s, e) for s, e, m in spans if m == ev.member and s <= ev.at_ns < e]
        if not old:
            continue
        last_old = max(e for _, e in old)
        new = [(s, e) for s, e, m in spans if m != ev.member and ev.at_ns < s < last_old]
        worst = 1.0
        for t, _ in new:  # each new admission: room it took while old ones were open
            n_old = sum(1 for s, e in old if s <= t < e)
            n_new = sum(1 for s, e in new if s <= t < e)
            if n_old:
                worst = min(worst, max(0.0, min(1.0, (limit - n_new) / n_old)))
        takeovers.append({"old_open": len(old), "restored": worst,
                          "peak_during": _peak(old + new)})  # fmt: skip
    return {"limit": limit, "peak": peak, "takeovers": takeovers}


def _peak(spans: Iterable[tuple[int, int]]) -> int:
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak
