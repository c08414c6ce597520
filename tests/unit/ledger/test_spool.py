"""The spool: fsynced frames, a bound, torn tails and corrupt segments."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from controlplane.domain.ledger_records import LedgerRecord
from controlplane.ledger.spool import CorruptSegment, Spool, SpoolFull


def rec(i: int) -> LedgerRecord:
    return LedgerRecord(
        "acme", f"r{i}", i, "standard", "m", "p", 1, 1, 2, 3, 4, 10, 5, 7, 20,
        Decimal("0.250000"), "request", Decimal("1.200000"), 300, Decimal("1.000000"), "USD",
        12345, 6789, 1,
    )  # fmt: skip


def test_append_seal_read_remove(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s", 1 << 20)
    sp.append([rec(1), rec(2)])
    sp.append([rec(3)])
    assert sp.bytes > 0
    (seg,) = sp.seal()
    frames = list(sp.read(seg))
    assert frames == [[rec(1), rec(2)], [rec(3)]]  # Decimals and ints round-trip exactly
    sp.append([rec(4)])  # a new segment after the seal
    assert len(sp.segments()) == 2
    sp.remove(seg, 3)
    assert [r.request_id for r in Spool(tmp_path / "s", 1 << 20).read_all()] == ["r4"]
    sp.remove(sp.seal()[0], 1)
    sp.close()
    assert not (tmp_path / "s").exists()


def test_bound_refuses_without_writing(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s", 600)
    sp.append([rec(1)])
    size = sp.bytes
    with pytest.raises(SpoolFull):
        sp.append([rec(i) for i in range(20)])
    assert sp.bytes == size == sum(p.stat().st_size for p in sp.segments())


def test_torn_tail_is_ignored_and_corruption_is_reported(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s", 1 << 20)
    sp.append([rec(1)])
    sp.append([rec(2)])
    (seg,) = sp.seal()
    data = seg.read_bytes()
    seg.write_bytes(data[:-3])  # a crash mid-write of the last (unacknowledged) frame
    assert [r.request_id for f in sp.read(seg) for r in f] == ["r1"]
    seg.write_bytes(b"XXXX" + data[4:])  # garbage at the head
    with pytest.raises(CorruptSegment):
        list(sp.read(seg))
