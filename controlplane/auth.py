"""Authentication of every call against an in-memory copy of the keys."""

from __future__ import annotations

from collections.abc import Mapping, Set
from datetime import UTC, datetime

from controlplane.domain.errors import Unauthenticated
from controlplane.domain.keys import SALT_BYTES, KeyVerifier, Principal, hash_secret, split_key
from controlplane.store.keys import KeyStore

# Key ids remembered as unknown at most (then forgotten all at once).
MAX_UNKNOWN = 10_000


class KeyCache:
    """An in-memory copy of the keys: every call is authenticated against it
    (no SQL per call, and none before the caller is known to hold a key: a
    database outage cannot hold up or leak into an authentication).
    Refreshed by the server's config poll when the table changed, at once
    after a key is created or revoked through the admin API, and on demand
    (rate-limited) when an operator presents a key id it does not know yet.

    A key id it does not know is remembered as unknown (``remember_unknown``)
    once a re-read of the keys has confirmed it, until the keys change: a
    repeat is refused from memory, without another re-read. Whether the
    last re-read reached the database (``note_refresh``, ``unreachable``)
    lets an unknown key be refused at once while it does not.

    It also records which keys were used (a set add per call, on the event
    loop); the server writes that to the database once per config poll
    (:meth:`take_used`, :meth:`save_used`), so a key's last use costs no SQL
    per call and is at most one poll interval old."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self._verifiers: Mapping[str, KeyVerifier] = {}
        self._fingerprint: tuple[object, ...] | None = None
        self.refreshes = 0
        self._used: set[str] = set()
        # key id -> ``refreshes`` when a re-read confirmed it unknown: valid
        # while no re-read has swapped the keys since (then it may exist).
        self._unknown: dict[str, int] = {}
        # The last re-read of the keys (poll or forced) failed or timed out.
        self.unreachable = False
        # How long a re-read that reached the database took, smoothed (s):
        # how long an unknown key's call may wait for one (rpc/auth.py).
        self.typical_refresh_s = 0.0

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the keys if the table changed (blocking: run in a thread)."""
        fp = self.store.fingerprint()
        if fp == self._fingerprint and not force:
            return False
        # Swapped as a whole: a reader on the loop sees the old or the new map.
        self._verifiers = self.store.verifiers()
        self._fingerprint = fp
        self.refreshes += 1
        return True

    def note_refresh(self, ok: bool, seconds: float | None = None) -> None:
        """A re-read of the keys reached the database or not (on the loop),
        and how long it took when it did."""
        self.unreachable = not ok
        if ok and seconds is not None:
            t = self.typical_refresh_s
            self.typical_refresh_s = seconds if t == 0.0 else 0.8 * t + 0.2 * seconds

    def known_unknown(self, key_id: str) -> bool:
        """A re-read since which the keys have not changed found no such id."""
        return self._unknown.get(key_id) == self.refreshes

    def remember_unknown(self, key_id: str, generation: int) -> None:
        """``key_id`` was not in the keys of ``generation`` (``refreshes``
        read before the lookup, after a re-read that reached the database)."""
        if len(self._unknown) >= MAX_UNKNOWN:
            self._unknown = {}  # a caller guessing ids: start over
        self._unknown[key_id] = generation

    def authenticate(self, key: str) -> Principal:
        principal = self.lookup(key)
        if principal is None:
            raise Unauthenticated("invalid or revoked API key")
        return principal

    def lookup(self, key: str) -> Principal | None:
        """The key's principal; None when its key id is not in the cache
        (perhaps created a moment ago by another process: the caller may
        refresh and look again). A wrong secret or a revoked key raises."""
        key_id, secret = split_key(key)
        verifier = self._verifiers.get(key_id)
        if verifier is None:
            # Hash anyway: an unknown id costs the same as a wrong secret.
            hash_secret(b"\0" * SALT_BYTES, secret)
            return None
        principal = verifier.check(secret)
        self._used.add(key_id)
        return principal

    # The set is only ever touched on the event loop: ``take_used`` swaps it
    # there, and only the taken copy goes to a worker thread.

    def take_used(self) -> Set[str]:
        """The keys used since the last call, and start a new record (on the loop)."""
        used, self._used = self._used, set()
        return used

    def give_back(self, used: Set[str]) -> None:
        """A write of ``take_used``'s keys failed: keep them for the next (on the loop)."""
        self._used |= used

    def save_used(self, used: Set[str]) -> None:
        """Write ``used`` as used now (blocking: run in a thread)."""
        if used:
            self.store.touch_last_used(used, datetime.now(UTC))
