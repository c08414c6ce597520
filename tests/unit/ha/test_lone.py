"""A lone member's longer leases (docs/ha.md, "Database outages"): the TTL
each acquire and renew asks for, the local deadline through a failed renew,
and a lease shortened when the member stops being lone — also when the
shortening renew's answer is lost. A fake store and a fake clock; the
coordinator's own code."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controlplane.domain.rendezvous import assignment
from controlplane.ha.coordinator import Coordinator

TTL, LONE, MARGIN = 1.0, 10.0, 0.25
# A member that loses cell "c" to "me" by rendezvous: "me" keeps it.
PEER = next(f"peer-{i}" for i in range(100) if assignment(["c"], ["me", f"peer-{i}"])["c"] == "me")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """Answers as the database would for one cell; ``down``: every call raises
    (after it may have been applied: ``applied_when_down``)."""

    def __init__(self, members: list[str]) -> None:
        self.members = members
        self.down = False
        self.applied_when_down = False
        self.asked: list[tuple[str, float]] = []  # (what, ttl)

    def _maybe_fail(self, apply: Any = None) -> None:
        if self.down:
            if self.applied_when_down and apply is not None:
                apply()
            raise ConnectionError("database unreachable")

    def heartbeat(self, *_: Any) -> None:
        self._maybe_fail()

    def live_members(self, _ttl: float) -> list[str]:
        self._maybe_fail()
        return list(self.members)

    def acquire(self, cell: str, me: str, ttl: float) -> int:
        self._maybe_fail()
        self.asked.append(("acquire", ttl))
        return 1

    def renew(self, cell: str, me: str, epoch: int, ttl: float) -> bool:
        self._maybe_fail(lambda: self.asked.append(("renew", ttl)))
        self.asked.append(("renew", ttl))
        return True

    def release(self, *_: Any) -> bool:
        self._maybe_fail()
        return True


def make(members: list[str]) -> tuple[Coordinator, FakeStore, Clock]:
    store, clock = FakeStore(members), Clock()
    coord = Coordinator(store, "me", "me:1", ["c"], ttl_s=TTL, margin_s=MARGIN,  # type: ignore[arg-type]
                        lone_ttl_s=LONE, clock=clock)  # fmt: skip
    return coord, store, clock


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_lone_member_takes_and_renews_for_the_lone_ttl() -> None:
    coord, store, clock = make(["me"])
    run(coord.tick())
    assert coord.lone and coord.owns("c") == 1
    assert store.asked == [("acquire", LONE)]
    assert coord.leases()["c"].deadline == pytest.approx(100.0 + LONE - MARGIN)
    clock.now += 0.3
    run(coord.tick())
    assert store.asked[-1] == ("renew", LONE)


def test_a_lone_member_keeps_its_cells_through_an_outage_until_the_lone_deadline() -> None:
    coord, store, clock = make(["me"])
    run(coord.tick())
    store.down = True
    for _ in range(30):  # 9 s of failing ticks: the ordinary TTL many times over
        clock.now += 0.3
        run(coord.tick())
        assert coord.owns("c") == 1
    assert coord.lone  # the last member list it read is kept
    clock.now = 100.0 + LONE - MARGIN
    assert coord.owns("c") is None  # the deadline of its last good acquire


def test_a_member_with_others_live_stops_at_the_ordinary_deadline() -> None:
    coord, store, clock = make(["me", PEER])
    run(coord.tick())
    assert not coord.lone and coord.owns("c") == 1
    assert store.asked == [("acquire", TTL)]
    store.down = True
    clock.now += 0.3
    run(coord.tick())
    assert coord.owns("c") == 1
    clock.now = 100.0 + TTL - MARGIN
    assert coord.owns("c") is None


@pytest.mark.parametrize("applied", [False, True])
def test_a_member_no_longer_lone_shortens_its_lease_even_when_the_answer_is_lost(
    applied: bool,
) -> None:
    coord, store, clock = make(["me"])
    run(coord.tick())  # lone: deadline 100 + 9.75
    store.members = ["me", PEER]  # a peer joins: the next read sees it
    clock.now += 0.3
    run(coord.tick())  # renewed lone (members are read after the renew), then not lone
    assert not coord.lone and coord.owns("c") == 1
    assert coord.leases()["c"].deadline == pytest.approx(100.3 + LONE - MARGIN)
    # The next renew asks for the ordinary TTL. Its answer is lost (the
    # database may or may not have applied it): the lease is trusted no
    # longer than that renew allows, not to the lone deadline.
    store.down, store.applied_when_down = True, applied
    clock.now += 0.3
    sent = clock.now
    run(coord.tick())
    assert coord.leases()["c"].deadline == pytest.approx(sent + TTL - MARGIN)
    clock.now = sent + TTL - MARGIN
    assert coord.owns("c") is None


def test_the_lone_ttl_is_never_shorter_than_the_ttl() -> None:
    store = FakeStore(["me"])
    coord = Coordinator(store, "me", "me:1", ["c"], ttl_s=5.0, margin_s=1.0,  # type: ignore[arg-type]
                        lone_ttl_s=2.0)  # fmt: skip
    coord.members = ["me"]
    assert coord.lease_ttl() == 5.0
