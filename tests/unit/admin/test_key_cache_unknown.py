"""The key cache's memory of unknown key ids (issue 30, item 14): an id a
re-read did not know is refused from memory until the keys change, and a
re-read that swaps the keys forgets it — also one that lands between the
lookup and the remembering (the generation read before the lookup)."""

from __future__ import annotations

from typing import Any

from controlplane.auth import MAX_UNKNOWN, KeyCache


class FakeStore:
    def __init__(self) -> None:
        self.version = 0

    def fingerprint(self) -> tuple[object, ...]:
        return (self.version,)

    def verifiers(self) -> dict[str, Any]:
        return {}


def test_an_unknown_id_is_remembered_until_the_keys_change() -> None:
    store = FakeStore()
    cache = KeyCache(store)  # type: ignore[arg-type]
    cache.refresh()
    cache.remember_unknown("abc", cache.refreshes)
    assert cache.known_unknown("abc") and not cache.known_unknown("other")
    assert not cache.refresh()  # nothing changed: still known to be unknown
    assert cache.known_unknown("abc")
    store.version += 1  # a key was created or revoked
    assert cache.refresh()
    assert not cache.known_unknown("abc")


def test_a_swap_between_the_lookup_and_the_remembering_wins() -> None:
    store = FakeStore()
    cache = KeyCache(store)  # type: ignore[arg-type]
    cache.refresh()
    generation = cache.refreshes  # read before the lookup
    store.version += 1
    cache.refresh()  # the key may exist now
    cache.remember_unknown("abc", generation)
    assert not cache.known_unknown("abc")


def test_the_memory_is_bounded() -> None:
    cache = KeyCache(FakeStore())  # type: ignore[arg-type]
    for i in range(MAX_UNKNOWN + 5):
        cache.remember_unknown(f"id{i}", cache.refreshes)
    assert len(cache._unknown) <= MAX_UNKNOWN


def test_unreachable_follows_the_last_re_read() -> None:
    cache = KeyCache(FakeStore())  # type: ignore[arg-type]
    assert not cache.unreachable
    cache.note_refresh(False)
    assert cache.unreachable
    cache.note_refresh(True)
    assert not cache.unreachable


def test_the_typical_re_read_time_follows_the_ones_that_reached_the_database() -> None:
    """An unknown key's call waits up to 4x this (rpc/auth.py): a loaded
    SQLite file whose re-reads take 0.4 s must not refuse a key created a
    moment ago, a database that hangs must not hold a call up longer."""
    cache = KeyCache(FakeStore())  # type: ignore[arg-type]
    assert cache.typical_refresh_s == 0.0
    cache.note_refresh(True, 0.4)
    assert cache.typical_refresh_s == 0.4  # the first one as it is
    cache.note_refresh(False, 9.0)  # a failed re-read says nothing of the time
    assert cache.typical_refresh_s == 0.4 and cache.unreachable
    cache.note_refresh(True, 0.01)
    assert 0.01 < cache.typical_refresh_s < 0.4 and not cache.unreachable
