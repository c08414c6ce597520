"""What metering keeps in memory for a while (the recent records that answer
duplicates, the spool's pending records) is kept as plain tuples: the
garbage collector stops tracking them after one collection, so full
collections do not walk them. The answers built from them are the same
LedgerRecords, every field."""

from __future__ import annotations

import gc
from pathlib import Path

from controlplane.domain.ledger_records import LedgerRecord
from controlplane.store.ledger import LedgerStore
from tests.integration.ledger.conftest import Served, complete
from tests.unit.ledger.test_writer_pipeline import FakeStore, rec, run


def test_recent_records_are_untracked_plain_tuples(served: Served) -> None:
    c = served.client
    for i in range(5):
        c.admit("acme", f"k{i}", prompt_tokens=100, max_tokens=100)
        assert not complete(c, "acme", f"k{i}", prompt_tokens=100, generated_tokens=7).duplicate
    metering = served.srv.plane.metering

    def kept() -> list[bool]:
        gc.collect()
        return [gc.is_tracked(row) or type(row) is not tuple for row in metering._recent.values()]

    assert served.srv.on_loop(kept) == [False] * 5
    # A duplicate is answered from the kept tuple with the stored record's figures.
    again = complete(c, "acme", "k3", prompt_tokens=1, generated_tokens=1)
    assert again.duplicate
    stored = LedgerStore(metering.engine).fetch(("acme", "k3"))
    assert stored is not None and again.user_charge and again.actual_tokens == 107
    found = served.srv.on_loop(lambda: metering._recent[("acme", "k3")])
    assert LedgerRecord._make(found) == stored


def test_pending_records_are_untracked_plain_tuples(tmp_path: Path) -> None:
    writer, _ = run(FakeStore(fail=[1]), tmp_path, 50, batch_max=100)  # all spooled
    assert len(writer.pending) == 50
    gc.collect()
    assert not any(gc.is_tracked(row) for row in writer.pending.values())
    for i in range(50):
        assert writer.pending_record(rec(i).key) == rec(i)
    assert writer.pending_record(("acme", "nope")) is None
