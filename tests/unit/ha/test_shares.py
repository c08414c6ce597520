"""The share rules (controlplane/domain/shares.py) on a model of several members
refreshing in any order, dying and spending: the sums never pass the
tenant's limits, and live members with steady demand converge to their
demand-weighted shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.domain.shares import (
    PPM,
    MemberShare,
    QuotaHolding,
    RateHolding,
    quota_allowance,
    rate_share,
    rate_target,
)


@dataclass
class Member:
    name: str
    demand: int
    rate_ppm: int = 0
    live: bool = True
    used: int = 0
    allowance: int = 0


@dataclass
class Tenant:
    quota: int
    members: dict[str, Member] = field(default_factory=dict)

    def refresh(self, name: str) -> None:
        """One member's refresh under the lock, as ShareStore.refresh does."""
        m = self.members[name]
        m.live = True
        others = [x for x in self.members.values() if x.name != name]
        m.rate_ppm = rate_share(m.demand, [RateHolding(x.name, x.demand, x.rate_ppm, x.live)
                                           for x in others])  # fmt: skip
        m.allowance = quota_allowance(m.used, self.quota, m.rate_ppm,
                                      [QuotaHolding(x.name, x.used, x.allowance)
                                       for x in others])  # fmt: skip

    def live_rate(self) -> int:
        return sum(m.rate_ppm for m in self.members.values() if m.live)


names = st.sampled_from(["a", "b", "c", "d"])
steps = st.lists(
    st.one_of(
        st.tuples(st.just("refresh"), names),
        st.tuples(st.just("die"), names),  # its rate grant expires
        st.tuples(st.just("spend"), names, st.integers(0, 5_000)),
        st.tuples(st.just("demand"), names, st.integers(0, 10_000)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=4, max_size=4), st.integers(0, 100_000), steps)
def test_the_sums_never_pass_the_limits(demands: list[int], quota: int,
                                        script: list[tuple[object, ...]]) -> None:  # fmt: skip
    t = Tenant(quota, {n: Member(n, d, live=False) for n, d in zip("abcd", demands, strict=True)})
    for step in script:
        kind, name = step[0], str(step[1])
        m = t.members[name]
        if kind == "refresh":
            t.refresh(name)
        elif kind == "die":
            m.live = False  # its allowance stays counted (spent tokens stay spent)
        elif kind == "spend" and m.live:
            # a member spends only within its allowance
            m.used += min(int(step[2]), m.allowance - m.used)  # type: ignore[call-overload]
        elif kind == "demand":
            m.demand = int(step[2])  # type: ignore[call-overload]
        assert t.live_rate() <= PPM
        assert sum(x.allowance for x in t.members.values()) <= max(quota, 0)
        assert all(0 <= x.used <= x.allowance for x in t.members.values())


@pytest.mark.parametrize("demands", [(1, 1, 1, 1), (100, 300, 0, 600), (5, 0, 0, 0)])
def test_steady_demand_converges_to_the_weighted_shares_in_two_rounds(
    demands: tuple[int, ...],
) -> None:
    t = Tenant(1_000_000, {n: Member(n, d, live=False)
                           for n, d in zip("abcd", demands, strict=True)})  # fmt: skip
    for _ in range(2):
        for n in "abcd":
            t.refresh(n)
    total = sum(demands)
    for n, d in zip("abcd", demands, strict=True):
        want = d * PPM // total
        assert t.members[n].rate_ppm == want, (n, t.members[n].rate_ppm, want)
    assert t.live_rate() <= PPM and t.live_rate() >= PPM - len(demands)


def test_a_dead_members_rate_is_freed_but_its_allowance_kept() -> None:
    t = Tenant(1000, {"a": Member("a", 10), "b": Member("b", 10)})
    for n in "abab":
        t.refresh(n)
    assert (t.members["a"].rate_ppm, t.members["b"].rate_ppm) == (PPM // 2, PPM // 2)
    t.members["a"].used = 300
    t.members["b"].live = False
    t.refresh("a")
    assert t.members["a"].rate_ppm == PPM  # b's rate is free once its grant expired
    # b still holds its allowance: a gets a share of what nobody used, within what b left
    assert t.members["a"].allowance == 1000 - t.members["b"].allowance


def test_idle_tenant_is_split_equally_and_targets_add_up() -> None:
    others = [RateHolding("b", 0, 0, True), RateHolding("c", 0, 0, True),
              RateHolding("d", 0, 0, False)]  # fmt: skip
    assert rate_target(0, others) == PPM // 3
    assert MemberShare(250_000, None, None).scale(1000) == 250


def test_bad_quota_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="share_ppm"):
        quota_allowance(0, 10, PPM + 1, [])
