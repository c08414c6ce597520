"""Rendezvous hashing (controlplane/domain/rendezvous.py): properties."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.domain.rendezvous import assignment, owner_of, weight

ids = st.text(min_size=1, max_size=12).filter(lambda s: "\0" not in s)
members_st = st.lists(ids, min_size=1, max_size=8, unique=True)
cells_st = st.lists(ids, min_size=1, max_size=30, unique=True)


def test_weight_is_blake2b_of_member_nul_cell() -> None:
    # Pinned: every replica, whatever its Python, must compute the same number.
    expected = hashlib.blake2b(b"replica-a\0pool-1", digest_size=8).digest()
    assert weight("replica-a", "pool-1") == int.from_bytes(expected, "big")
    assert weight("ab", "c") != weight("a", "bc")


def test_no_members_is_an_error_naming_the_cell() -> None:
    with pytest.raises(ValueError, match="'pool-1' has no live member"):
        owner_of("pool-1", [])


@settings(max_examples=200, deadline=None)
@given(cells_st, members_st, st.randoms(use_true_random=False))
def test_deterministic_whatever_the_order(
    cells: list[str], members: list[str], rnd: random.Random
) -> None:
    shuffled = list(members)
    rnd.shuffle(shuffled)
    assert assignment(cells, members) == assignment(cells, shuffled)


@settings(max_examples=200, deadline=None)
@given(cells_st, members_st)
def test_every_cell_goes_to_a_live_member(cells: list[str], members: list[str]) -> None:
    got = assignment(cells, members)
    assert set(got) == set(cells)
    assert set(got.values()) <= set(members)


@settings(max_examples=200, deadline=None)
@given(cells_st, members_st, ids)
def test_a_new_member_takes_only_the_cells_it_wins(
    cells: list[str], members: list[str], new: str
) -> None:
    if new in members:
        return
    before = assignment(cells, members)
    after = assignment(cells, [*members, new])
    for cell in cells:
        if after[cell] != before[cell]:
            assert after[cell] == new  # moved only to the newcomer


@settings(max_examples=200, deadline=None)
@given(cells_st, members_st.filter(lambda m: len(m) >= 2), st.data())
def test_a_member_leaving_moves_only_its_cells(
    cells: list[str], members: list[str], data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(members))
    before = assignment(cells, members)
    after = assignment(cells, [m for m in members if m != gone])
    for cell in cells:
        if before[cell] != gone:
            assert after[cell] == before[cell]
        else:
            assert after[cell] != gone


def test_cells_spread_over_members() -> None:
    # Not a property (chance), but with 3,000 cells a member far off a third
    # would mean a broken weight function.
    cells = [f"pool-{i}" for i in range(3000)]
    got = assignment(cells, ["a", "b", "c"])
    counts = {m: sum(1 for o in got.values() if o == m) for m in "abc"}
    assert all(800 < n < 1200 for n in counts.values()), counts
