"""Rendezvous (highest-random-weight) hashing: which member owns a cell.

Every member computes a weight for (member, cell) and the highest weight
wins. All replicas agree without talking, given the same member list; when a
member joins it takes exactly the cells where it now has the top weight, and
when one leaves only its own cells move (each to its runner-up), so cells
move minimally and spread evenly.

The weight is the first 8 bytes of BLAKE2b(member_id NUL cell_id): stable
across processes, Python versions and machines, unlike ``hash()``, which is
salted per process. NUL separates the two so ("ab", "c") and ("a", "bc")
never collide by construction (identifiers are text without NUL).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(member: str, cell: str) -> int:
    """The 64-bit weight of ``member`` for ``cell``."""
    digest = hashlib.blake2b(member.encode() + b"\0" + cell.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner_of(cell: str, members: Iterable[str]) -> str:
    """The member with the highest weight for ``cell`` (ties, which need a
    64-bit collision, go to the greater member id, so the answer is still
    the same everywhere). ValueError when there is no member."""
    best: tuple[int, str] | None = None
    for member in members:
        key = (weight(member, cell), member)
        if best is None or key > best:
            best = key
    if best is None:
        raise ValueError(f"cell {cell!r} has no live member to belong to")
    return best[1]


def assignment(cells: Iterable[str], members: Iterable[str]) -> dict[str, str]:
    """Every cell's owner among ``members`` (ValueError when there is none)."""
    pool = sorted(set(members))
    return {cell: owner_of(cell, pool) for cell in cells}
