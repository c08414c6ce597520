"""The ownership trace (controlplane/ha/trace.py) and the acceptance
harness's checks over it (checks.py): the trace's intervals are exactly the
coordinators' own (a killed member's interval ends at its last deadline),
the checks find a double owner and a stale window write when the trace
shows one, and a fenced window write leaves a line only when it landed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from controlplane.domain.pricing import WindowSummary
from controlplane.ha import trace
from controlplane.ledger.fencing import StaleWrites, WindowWriter
from controlplane.store.leases import StaleEpoch
from tests.integration.ha import checks
from tests.integration.ha.harness import Member, until

TTL_S, MARGIN_S = 1.0, 0.25
CELLS = ["c1", "c2", "c3"]


@pytest.fixture
def trace_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "trace.jsonl"
    trace.configure(path, "proc")
    try:
        yield path
    finally:
        trace.configure(None, "")  # the sink is process-wide: leave it off


@pytest.mark.postgres
def test_trace_intervals_are_the_coordinators_own(ha_url: str, trace_file: Path) -> None:
    members = asyncio.run(_pause_kill_drain(ha_url))
    got = checks.read_traces([trace_file])
    want = []
    for m in members:
        want += [
            (i.member, i.cell, i.epoch, trace.ns(i.valid_from), trace.ns(i.valid_until))
            for i in m.coord.history
        ]
        # a killed member's leases, never closed: valid to their deadlines
        want += [
            (m.name, c, lease.epoch, trace.ns(lease.valid_from), trace.ns(lease.deadline))
            for c, lease in m.coord.leases().items()
        ]
    assert sorted(
        (v.member, v.cell, v.epoch, v.start_ns, v.end_ns) for v in got.intervals
    ) == sorted(want)
    assert {v.how for v in got.intervals} >= {"expired", "drain", "deadline"}
    assert checks.overlaps(got) == []
    assert checks.epoch_disorder(got) == []

    # the same trace with one lease's end moved past its successor's start
    lines = [json.loads(x) for x in trace_file.read_text().splitlines()]
    by_cell = sorted((v for v in got.intervals if v.how == "expired"), key=lambda v: v.start_ns)
    first = by_cell[0]
    nxt = next(v for v in got.of_cell(first.cell) if v.start_ns > first.start_ns)
    for line in lines:
        if line["ev"] == "end" and (line["cell"], line["epoch"]) == (first.cell, first.epoch):
            line["end_ns"] = nxt.start_ns + 1_000_000
    bad = trace_file.parent / "bad.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
    found = checks.overlaps(checks.read_traces([bad]))
    assert [(a.epoch, b.epoch) for a, b in found] == [(first.epoch, nxt.epoch)]

    # a window write of the old epoch: landed after the new lease began
    # (stale), or begun before and committed after (not provably stale)
    write = {"ev": "window_write", "member": "proc", "pid": 1, "cell": first.cell,
             "epoch": first.epoch, "rows": 1}  # fmt: skip
    extra = [
        {**write, "begin_ns": nxt.start_ns + 10, "done_ns": nxt.start_ns + 20},
        {**write, "begin_ns": nxt.start_ns - 10, "done_ns": nxt.start_ns + 20},
        {**write, "begin_ns": first.start_ns + 10, "done_ns": first.start_ns + 20},
    ]
    with trace_file.open("a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in extra))
    stale, ambiguous = checks.stale_writes(checks.read_traces([trace_file]))
    assert [w["begin_ns"] for w in stale] == [nxt.start_ns + 10]
    assert ambiguous == 1


async def _pause_kill_drain(url: str) -> list[Member]:
    a, b = (Member(url, n, CELLS, ttl_s=TTL_S, margin_s=MARGIN_S) for n in "ab")
    try:
        a.start()
        await until(lambda: set(a.coord.owned()) == set(CELLS), "a to own every cell")
        b.start()
        await until(lambda: bool(b.coord.owned()), "b to take its cells")
        a.pause()  # SIGSTOP past the TTL: a self-fences, b takes everything
        await until(lambda: set(b.coord.owned()) == set(CELLS), "b to own every cell")
        await asyncio.sleep(0.2)
        a.resume()
        await until(lambda: bool(a.coord.owned()), "a back with its cells")
        await b.kill()  # kill -9: no end line; its leases end at their deadlines
        await until(lambda: set(a.coord.owned()) == set(CELLS), "a to take b's cells")
        await a.drain()
    finally:
        for m in (a, b):
            m.resume()
            m.close()
    return [a, b]


class _Store:
    """LedgerStore.save_windows: lands, or refused by the fence."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse

    def save_windows(self, rows: Any, fence: tuple[str, int] | None) -> None:
        if self.refuse and fence is not None:
            raise StaleEpoch(fence[0], fence[1], fence[1] + 1)


class _Book:
    def drop_pools(self, pools: Any) -> None:
        pass


def _row(pool: str) -> WindowSummary:
    return WindowSummary(pool, "m", 0, 60, 1, 1, 1, 0, 0, None, Decimal(1), Decimal(1), False)


@pytest.mark.parametrize("refuse", [False, True])
def test_fenced_window_writes_are_traced(trace_file: Path, refuse: bool) -> None:
    writer = WindowWriter(_Store(refuse), _Book(), lambda pool: ("cell-a", 7), StaleWrites())  # type: ignore[arg-type]
    writer.installed(["p"])
    writer.write(writer.plan([_row("p")]))
    lines = [json.loads(x) for x in trace_file.read_text().splitlines()]
    assert [(x["ev"], x["cell"], x["epoch"], x["rows"]) for x in lines] == [
        ("window_refused" if refuse else "window_write", "cell-a", 7, 1)
    ]
    assert lines[0]["begin_ns"] <= lines[0]["done_ns"]


def test_trace_is_off_by_default(tmp_path: Path) -> None:
    assert trace.SINK is None
    writer = WindowWriter(_Store(False), _Book(), lambda pool: ("cell-a", 7), StaleWrites())  # type: ignore[arg-type]
    writer.installed(["p"])
    writer.write(writer.plan([_row("p")]))  # no sink: nothing to write, nothing fails
    assert list(tmp_path.iterdir()) == []
