"""Authentication of admission calls against an in-memory copy of the keys."""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.domain.errors import Unauthenticated
from controlplane.domain.keys import SALT_BYTES, KeyVerifier, Principal, hash_secret, split_key
from controlplane.store.keys import KeyStore


class KeyCache:
    """An in-memory copy of the keys for the admission path (no SQL per
    Admit). Refreshed by the server's config poll when the table changed, and
    at once after a key is created or revoked through the admin API."""

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
        key_id, secret = split_key(key)
        verifier = self._verifiers.get(key_id)
        if verifier is None:
            hash_secret(b"\0" * SALT_BYTES, secret)
            raise Unauthenticated("invalid or revoked API key")
        return verifier.check(secret)
