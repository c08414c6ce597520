"""The pieces of a takeover without a database: what quota usage a rebuild
imports (``CountedUsage``) and a book taking pools over (``install``)."""

from __future__ import annotations

from decimal import Decimal

from controlplane.domain.pricing import StepTable
from controlplane.domain.units import NS_PER_HOUR
from controlplane.ledger.fencing import UNFENCED, no_fencing
from controlplane.ledger.pricing import PricingBook
from controlplane.ledger.takeover import CountedUsage

S = 1_000_000_000
W = 300 * S
T0 = 5_666_666 * W + 10 * S  # inside a window, and 22 min into an hour


def known(tenant: str) -> bool:
    return tenant != "gone"


def test_usage_imports_only_what_the_counters_do_not_hold() -> None:
    u = CountedUsage()
    u.settled("acme", "p", 700, T0, T0)  # settled here: already in the counters
    hour = {("acme", "p"): 1000, ("acme", "q"): 50, ("beta", "p"): 5, ("gone", "p"): 9}
    add_h, add_d = u.gaps(hour, dict(hour), T0, T0, known)
    assert add_h == add_d == {"acme": 300 + 50, "beta": 5}  # unknown tenants skipped
    assert u.gaps(hour, dict(hour), T0, T0, known) == ({}, {})  # idempotent
    hour[("acme", "p")] = 1200  # 200 more settled elsewhere since
    assert u.gaps(hour, {}, T0, T0, known)[0] == {"acme": 200}


def test_usage_read_in_a_previous_hour_imports_nothing_for_the_hour() -> None:
    u = CountedUsage()
    next_hour = T0 - T0 % NS_PER_HOUR + NS_PER_HOUR
    add_h, add_d = u.gaps({("acme", "p"): 10}, {("acme", "p"): 10}, T0, next_hour, known)
    assert add_h == {} and add_d == {"acme": 10}  # same day, new hour
    u.settled("acme", "p", 5, T0, next_hour)  # settled last hour: not this hour's
    assert u.hour == {}


def book() -> PricingBook:
    return PricingBook(300, StepTable([(Decimal("0.30"), Decimal("1.50"))]))


def test_install_replaces_the_pools_windows_with_the_stored_ones() -> None:
    owner = book()
    owner.quote("p", "m", T0)
    owner.observe_completion("p", "m", 100, 900_000, T0)
    stored = owner.snapshot(T0 + W)  # k closed (0.9: 1.5 next), k+1 open
    assert owner.quote("p", "m", T0 + W).multiplier == 1.5

    taker = book()
    taker.quote("p", "m", T0 + W)  # a quote before the rebuild: 1.0
    taker.quote("other", "m", T0 + W)
    taker.observe_completion("other", "m", 100, 900_000, T0 + W)
    taker.install(["p"], stored)
    assert taker.quote("p", "m", T0 + W).multiplier == 1.5  # carried on
    assert {p for p, *_ in taker.in_force()} == {"p", "other"}  # other pools untouched
    taker.drop_pools(["p", "other"])
    assert taker.in_force() == [] and taker.snapshot(T0 + W) == []


def test_unfenced_is_not_not_owned() -> None:
    assert no_fencing("any") is UNFENCED and UNFENCED is not None
