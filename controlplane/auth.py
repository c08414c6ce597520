"""Authentication of admission calls against an in-memory copy of the keys."""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.domain.errors import Unauthenticated
from controlplane.domain.keys import SALT_BYTES, KeyVerifier, Principal, hash_secret, split_key
from controlplane.store.keys import KeyStore


class KeyCache:
    """An in-memory copy of the keys: every call is authenticated against it
    (no SQL per call, and none before the caller is known to hold a key: a
    database outage cannot hold up or leak into an authentication).
    Refreshed by the server's config poll when the table changed, at once
    after a key is created or revoked through the admin API, and on demand
    (rate-limited) when an operator presents a key id it does not know yet."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self._verifiers: Mapping[str, KeyVerifier] = {}
        self._fingerprint: tuple[object, ...] | None = None
        self.refreshes = 0

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
        return verifier.check(secret)
