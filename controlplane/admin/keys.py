"""API keys and per-sidecar tokens.

A key looks like ``bgk_<key_id>_<secret>``: ``key_id`` (12 hex chars) is
public and finds the row; ``secret`` is 32 random bytes (URL-safe base64).
Only ``HMAC-SHA256(salt, secret)`` with a per-key random salt is stored, and
a presented secret is compared with :func:`hmac.compare_digest` (constant
time). A slow password hash (bcrypt, scrypt) is for low-entropy secrets that
people choose; a 256-bit random secret cannot be guessed, and a slow hash
would cost milliseconds on every authenticated Admit.

Roles: ``admin`` (admin API, read and write), ``viewer`` (admin API, read
only), ``sidecar`` (the admission API only). Keys are created and revoked
through the CLI (``burstgate keys ...``, DB-direct: the bootstrap path) or
the admin API; every creation and revocation is audited.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from controlplane.admin.errors import Unauthenticated
from controlplane.errors import InvalidArgument, NotFound
from controlplane.store.models import ApiKey

KEY_PREFIX = "bgk"
KEY_ID_BYTES = 6  # 12 hex chars: public, only needs to be unique
SECRET_BYTES = 32  # 256 bits of entropy
SALT_BYTES = 16
MAX_NAME_LEN = 128


class Role(enum.StrEnum):
    ADMIN = "admin"
    VIEWER = "viewer"
    SIDECAR = "sidecar"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key's public id, its name and role."""

    key_id: str
    name: str
    role: Role

    @property
    def actor(self) -> str:
        return f"key:{self.key_id} ({self.name})"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A key as listed (never the secret)."""

    key_id: str
    name: str
    role: Role
    created_by: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def hash_secret(salt: bytes, secret: str) -> str:
    # hmac.digest is the one-shot C path: ~1 us, against ~4 us for hmac.new.
    return hmac.digest(salt, secret.encode(), "sha256").hex()


def new_key() -> tuple[str, str, str, str]:
    """A fresh key: (full key to show once, key_id, salt hex, secret hash)."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    salt = secrets.token_bytes(SALT_BYTES)
    return f"{KEY_PREFIX}_{key_id}_{secret}", key_id, salt.hex(), hash_secret(salt, secret)


def split_key(key: str) -> tuple[str, str]:
    """``bgk_<key_id>_<secret>`` -> (key_id, secret); Unauthenticated if malformed."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        raise Unauthenticated("malformed API key (expected bgk_<id>_<secret>)")
    return parts[1], parts[2]


def bearer_token(metadata: object) -> str:
    """The key from ``authorization: Bearer <key>`` metadata."""
    value: str | bytes | None = None
    for item in metadata or ():  # type: ignore[attr-defined]
        if item[0] == "authorization":
            value = item[1]
            break
    if value is None:
        raise Unauthenticated("missing credentials: send 'authorization: Bearer <API key>'")
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must be 'Bearer <API key>'")
    return token.strip()


@dataclass(frozen=True, slots=True)
class _Verifier:
    salt: bytes
    secret_hash: str
    principal: Principal
    revoked: bool

    def check(self, secret: str) -> Principal:
        # Compare even for revoked keys so that timing does not tell them apart.
        ok = hmac.compare_digest(hash_secret(self.salt, secret), self.secret_hash)
        if not ok or self.revoked:
            raise Unauthenticated("invalid or revoked API key")
        return self.principal


def _verifier(row: ApiKey) -> _Verifier:
    return _Verifier(
        bytes.fromhex(row.salt),
        row.secret_hash,
        Principal(row.key_id, row.name, Role(row.role)),
        row.revoked_at is not None,
    )


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        row.key_id, row.name, Role(row.role), row.created_by, row.created_at, row.revoked_at
    )


def parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        raise InvalidArgument(
            "role", f"unknown role {value!r}; one of {', '.join(r.value for r in Role)}"
        ) from None


class KeyStore:
    """API keys in the database. ``create``/``revoke`` take an open session so
    the caller can write the audit record in the same transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @staticmethod
    def create(s: Session, name: str, role: Role, created_by: str) -> tuple[str, KeyInfo]:
        name = name.strip()
        if not name:
            raise InvalidArgument("name", "must not be empty")
        if len(name) > MAX_NAME_LEN or not name.isprintable():
            raise InvalidArgument("name", f"1..{MAX_NAME_LEN} printable characters")
        key, key_id, salt, digest = new_key()
        row = ApiKey(
            key_id=key_id,
            name=name,
            role=role.value,
            salt=salt,
            secret_hash=digest,
            created_by=created_by[:256],
        )
        s.add(row)
        s.flush()
        return key, _info(row)

    @staticmethod
    def revoke(s: Session, key_id: str) -> tuple[KeyInfo, KeyInfo]:
        """Revoke; returns (before, after). Revoking twice is a no-op."""
        row = s.scalar(select(ApiKey).where(ApiKey.key_id == key_id))
        if row is None:
            raise NotFound("key_id", f"unknown key {key_id!r}")
        before = _info(row)
        if row.revoked_at is None:
            row.revoked_at = datetime.now(UTC)
            s.flush()
        return before, _info(row)

    def list(self, *, include_revoked: bool = True) -> list[KeyInfo]:
        with Session(self.engine) as s:
            q = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
            if not include_revoked:
                q = q.where(ApiKey.revoked_at.is_(None))
            return [_info(r) for r in s.scalars(q)]

    def authenticate(self, key: str) -> Principal:
        """Check a presented key against the database (admin calls: a revoke
        made by any process applies to the very next call)."""
        key_id, secret = split_key(key)
        with Session(self.engine) as s:
            row = s.scalar(select(ApiKey).where(ApiKey.key_id == key_id))
            if row is None:
                # Hash anyway: an unknown id costs the same as a wrong secret.
                hash_secret(b"\0" * SALT_BYTES, secret)
                raise Unauthenticated("invalid or revoked API key")
            verifier = _verifier(row)
        return verifier.check(secret)

    def fingerprint(self) -> tuple[object, ...]:
        with Session(self.engine) as s:
            return tuple(
                s.execute(select(func.count(ApiKey.id), func.max(ApiKey.updated_at))).one()
            )

    def verifiers(self) -> dict[str, _Verifier]:
        with Session(self.engine) as s:
            return {r.key_id: _verifier(r) for r in s.scalars(select(ApiKey))}


class KeyCache:
    """An in-memory copy of the keys for the admission path (no SQL per
    Admit). Refreshed by the server's config poll when the table changed, and
    at once after a key is created or revoked through the admin API."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self._verifiers: Mapping[str, _Verifier] = {}
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
