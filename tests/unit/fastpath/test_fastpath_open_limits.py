"""Memory protection in the token-bucket table: caps on open reservations (requests in
flight) over all slots and per slot (``set_open_limits``), refused OPEN_RESERVATIONS.
Run against both builds (``impl``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest

from fastpath.codes import NS_PER_DAY, Reason

T0 = 20_000 * NS_PER_DAY
OK = Reason.OK
OPEN = Reason.OPEN_RESERVATIONS


def table_of(impl: ModuleType, slots: int = 2, **config: int) -> Any:
    table = impl.TokenBucketTable(4)
    for slot in range(slots):
        table.configure(
            slot, T0, 1_000, 1_000_000, config.get("hourly", 0), 0, config.get("conc", 0), 0
        )
    return table


def test_caps_are_off_by_default_and_settable(impl: ModuleType) -> None:
    table = table_of(impl)
    assert table.open_limits() == (0, 0)
    for i in range(50):  # no cap: nothing refused for it
        assert table.admit(i % 2, T0, 1, 1)[0] == OK
    assert table.total_inflight() == 50
    table.set_open_limits(10, 3)
    assert table.open_limits() == (10, 3)


@pytest.mark.parametrize(("total", "per_slot", "name"), [(-1, 0, "total"), (0, -1, "per_slot")])
def test_bad_caps_are_refused_by_name(
    impl: ModuleType, total: int, per_slot: int, name: str
) -> None:
    table = table_of(impl)
    table.set_open_limits(5, 2)
    with pytest.raises(ValueError, match=name):
        table.set_open_limits(total, per_slot)
    with pytest.raises(TypeError):
        table.set_open_limits(1.5, 1)
    assert table.open_limits() == (5, 2)


def test_per_slot_cap_refuses_and_a_settle_or_release_frees_a_place(impl: ModuleType) -> None:
    table = table_of(impl)
    table.set_open_limits(0, 2)
    assert table.admit(0, T0, 10, 5)[:2] == (OK, 15)
    assert table.admit(0, T0, 10, 5)[:2] == (OK, 15)
    before = table.snapshot(0)
    # nothing charged, no retry from the table (the service answers a hint), the bucket
    # and quotas reported as they are
    assert table.admit(0, T0, 10, 5) == (OPEN, 0, 0, 970, -1, -1)
    assert table.snapshot(0) == before
    assert table.admit(1, T0, 10, 5)[0] == OK  # another slot has its own cap
    table.settle(0, T0, 15, 3, T0)
    assert table.admit(0, T0, 10, 5)[0] == OK
    table.release(0, T0, 15)
    assert table.admit(0, T0, 10, 5)[0] == OK
    assert (table.inflight(0), table.total_inflight()) == (2, 3)


def test_total_cap_counts_every_slot(impl: ModuleType) -> None:
    table = table_of(impl, slots=3)
    table.set_open_limits(3, 0)
    assert [table.admit(s, T0, 1, 0)[0] for s in (0, 1, 2)] == [OK, OK, OK]
    assert [table.admit(s, T0, 1, 0)[0] for s in (0, 1, 2)] == [OPEN, OPEN, OPEN]
    assert table.total_inflight() == 3
    table.settle(1, T0, 1, 1, T0)
    assert table.admit(2, T0, 1, 0)[0] == OK
    assert table.admit(0, T0, 1, 0)[0] == OPEN
    table.remove(2)  # a forgotten slot takes its requests out of the count
    assert table.total_inflight() == 1
    assert table.admit(0, T0, 1, 0)[0] == OK


def test_other_refusals_keep_their_reason(impl: ModuleType) -> None:
    """Only what would be admitted is refused for memory: a request refused for its
    quota or concurrency says so (it reserves nothing either way)."""
    table = table_of(impl, hourly=100, conc=5)
    table.set_open_limits(0, 1)
    assert table.admit(0, T0, 50, 0)[0] == OK
    assert table.admit(0, T0, 60, 0)[0] == Reason.HOURLY_QUOTA
    assert table.admit(0, T0, 10, 0)[0] == OPEN
    table.configure(1, T0, 1_000, 1_000_000, 0, 0, 1, 0)
    table.set_open_limits(0, 1)
    assert table.admit(1, T0, 1, 0)[0] == OK
    # max_concurrency 1 binds first: the tenant's own limit, not memory protection
    assert table.admit(1, T0, 1, 0)[0] == Reason.CONCURRENCY


def test_shadow_charges_are_refused_at_the_cap_too(impl: ModuleType) -> None:
    """Shadow mode reserves whatever the would-be answer, except past the memory cap:
    the plane's memory is not a tenant limit to observe."""
    table = table_of(impl, conc=1)
    table.set_open_limits(0, 2)
    assert table.charge(0, T0, 5, 0)[:2] == (OK, 5)
    assert table.charge(0, T0, 5, 0)[:2] == (Reason.CONCURRENCY, 5)  # charged anyway
    before = table.snapshot(0)
    assert table.charge(0, T0, 5, 0)[:3] == (OPEN, 0, 0)
    assert table.snapshot(0) == before
    assert table.total_inflight() == 2


def test_a_batch_stops_at_the_cap_in_order(impl: ModuleType) -> None:
    table = table_of(impl)
    table.set_open_limits(5, 3)
    slots = np.array([0, 0, 1, 0, 0, 1, 1, 1, 0], dtype=np.int64)
    n = len(slots)
    ones = np.ones(n, dtype=np.int64)
    outs = [np.full(n, -99, dtype=np.int64) for _ in range(6)]
    admitted = table.admit_batch(T0, slots, ones, ones, *outs)
    #        slot:  0   0   1   0   0     1   1     1     0
    assert outs[0].tolist() == [OK, OK, OK, OK, OPEN, OK, OPEN, OPEN, OPEN]
    assert admitted == 5
    assert outs[1].tolist() == [2, 2, 2, 2, 0, 2, 0, 0, 0]
    assert (table.inflight(0), table.inflight(1), table.total_inflight()) == (3, 2, 5)


def test_lowering_a_cap_below_the_load_only_refuses_new_work(impl: ModuleType) -> None:
    table = table_of(impl)
    for _ in range(4):
        table.admit(0, T0, 1, 0)
    table.set_open_limits(2, 0)
    assert table.total_inflight() == 4
    assert table.admit(1, T0, 1, 0)[0] == OPEN
    for _ in range(3):
        table.release(0, T0, 1)
    assert table.admit(1, T0, 1, 0)[0] == OK
