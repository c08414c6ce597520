"""API keys and per-sidecar tokens.

A key looks like ``bgk_<key_id>_<secret>``: ``key_id`` (12 hex chars) is
public and finds the row; ``secret`` is 32 random bytes (URL-safe base64).
Only ``HMAC-SHA256(salt, secret)`` with a per-key random salt is stored, and
a presented secret is compared with :func:`hmac.compare_digest` (constant
time). A slow password hash (bcrypt, scrypt) is for low-entropy secrets that
people choose; a 256-bit random secret cannot be guessed, and a slow hash
would cost milliseconds on every authenticated Admit.

Roles: ``admin`` (admin API, read and write), ``viewer`` (admin API, read
only), ``sidecar`` (the admission API only, for the tenants and pools of its
scope: ``controlplane.domain.scope``). Any key may carry an expiry; an
expired key is refused like a revoked one. Keys are created and revoked
through the CLI (``burstgate keys ...``, DB-direct: the bootstrap path) or
the admin API; every creation and revocation is audited.
"""

from __future__ import annotations

import enum
import hmac
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from controlplane.domain.errors import InvalidArgument, Unauthenticated
from controlplane.domain.scope import KeyScope, check_patterns

KEY_PREFIX = "bgk"
KEY_ID_BYTES = 6  # 12 hex chars: public, only needs to be unique
SECRET_BYTES = 32  # 256 bits of entropy
SALT_BYTES = 16
MAX_NAME_LEN = 128
# The longest a key may be made to live (an expiry further out is a typo).
MAX_LIFETIME = timedelta(days=3650)


class Role(enum.StrEnum):
    ADMIN = "admin"
    VIEWER = "viewer"
    SIDECAR = "sidecar"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key's public id, its name and role; ``scope``, a
    sidecar key's tenants and pools (None: not limited by a scope, which is
    every admin and viewer key and a sidecar key for ``*`` and ``*``)."""

    key_id: str
    name: str
    role: Role
    scope: KeyScope | None = None

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
    # A sidecar key's scope (empty for admin and viewer keys).
    tenants: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    expires_at: datetime | None = None
    # Recorded by the server in memory, written at most once per config poll.
    last_used_at: datetime | None = None

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
    """The key from ``authorization: Bearer <key>`` metadata. Differing
    ``authorization`` entries are refused rather than one of them picked: a
    proxy that adds its own credentials must not have them decided by order.
    The same entry twice (a channel that adds the key, and a caller that
    adds it again) is not ambiguous."""
    value: str | bytes | None = None
    for item in metadata or ():  # type: ignore[attr-defined]
        if item[0] == "authorization":
            if value is not None and item[1] != value:
                raise Unauthenticated(
                    "ambiguous credentials: differing 'authorization' metadata entries; send one"
                )
            value = item[1]
    if value is None:
        raise Unauthenticated("missing credentials: send 'authorization: Bearer <API key>'")
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must be 'Bearer <API key>'")
    return token.strip()


@dataclass(frozen=True, slots=True)
class KeyVerifier:
    salt: bytes
    secret_hash: str
    principal: Principal
    revoked: bool
    # Unix seconds after which the key is refused; 0 = never expires.
    expires_s: float = 0.0

    def check(self, secret: str) -> Principal:
        # Compare even for revoked keys so that timing does not tell them apart.
        ok = hmac.compare_digest(hash_secret(self.salt, secret), self.secret_hash)
        if not ok or self.revoked:
            raise Unauthenticated("invalid or revoked API key")
        # Said only to the holder of the right secret: it tells them to get a new key.
        if self.expires_s and time.time() >= self.expires_s:
            raise Unauthenticated("expired API key")
        return self.principal


def parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        raise InvalidArgument(
            "role", f"unknown role {value!r}; one of {', '.join(r.value for r in Role)}"
        ) from None


def key_scope(
    role: Role, tenants: Sequence[str], pools: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validate the scope a key is created with: a sidecar key names its
    tenants and pools (``*`` = all, said explicitly); other roles have none."""
    if role is not Role.SIDECAR:
        for field, given in (("tenants", tenants), ("pools", pools)):
            if given:
                raise InvalidArgument(
                    field, f"only sidecar keys are scoped; a {role.value} key's role decides"
                )
        return (), ()
    return (
        check_patterns("tenants", tenants, "--tenant acme --tenant 'team-*' on the CLI"),
        check_patterns("pools", pools, "--pool pool-a on the CLI"),
    )


def check_expiry(field: str, expires_at: datetime | None, now: datetime) -> None:
    if expires_at is None:
        return
    if expires_at <= now:
        raise InvalidArgument(field, "must be in the future")
    if expires_at - now > MAX_LIFETIME:
        raise InvalidArgument(field, f"at most {MAX_LIFETIME.days} days ahead")


_DURATION = re.compile(r"(\d{1,5})([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(field: str, text: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w`` as a timedelta."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise InvalidArgument(
            field, f"{text[:20]!r} is not a duration like 30d, 12h, 15m, 90s or 2w"
        )
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds <= 0:
        raise InvalidArgument(field, "must be more than 0")
    return timedelta(seconds=seconds)


def expiry_after(field: str, text: str) -> datetime:
    """The expiry ``text`` (a duration) from now, checked."""
    now = datetime.now(UTC)
    when = now + parse_duration(field, text)
    check_expiry(field, when, now)
    return when
