"""API keys in the database (the SQL half of the key model; the key format,
roles and hashing are in ``controlplane.domain.keys``). ``create_key`` and
``revoke_key`` write the change and its audit record in one transaction."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, or_, select, update
from sqlalchemy.orm import Session

from controlplane.domain.audit import Actor
from controlplane.domain.errors import InvalidArgument, NotFound
from controlplane.domain.keys import (
    MAX_NAME_LEN,
    KeyInfo,
    KeyVerifier,
    Principal,
    Role,
    check_expiry,
    key_scope,
    new_key,
)
from controlplane.domain.scope import KeyScope
from controlplane.store.audit import aware, local_actor, log_change
from controlplane.store.models import ApiKey

# Keys whose last use one UPDATE records (a server has few keys; bounded anyway).
TOUCH_CHUNK = 500


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(json.loads(text)) if text else ()


def _scope(row: ApiKey) -> KeyScope | None:
    """A sidecar row's compiled scope; None when nothing limits the key
    (admin and viewer keys, a sidecar key for every tenant and pool). A
    sidecar row without a scope (written by an older version) may act for
    nothing: the empty scope."""
    if row.role != Role.SIDECAR.value:
        return None
    scope = KeyScope(_names(row.tenants), _names(row.pools))
    return None if scope.unrestricted else scope


def _verifier(row: ApiKey) -> KeyVerifier:
    return KeyVerifier(
        bytes.fromhex(row.salt),
        row.secret_hash,
        Principal(row.key_id, row.name, Role(row.role), _scope(row)),
        row.revoked_at is not None,
        aware(row.expires_at).timestamp() if row.expires_at is not None else 0.0,
    )


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        row.key_id, row.name, Role(row.role), row.created_by, row.created_at, row.revoked_at,
        _names(row.tenants), _names(row.pools),
        aware(row.expires_at) if row.expires_at is not None else None,
        aware(row.last_used_at) if row.last_used_at is not None else None,
    )  # fmt: skip


def key_dict(info: KeyInfo) -> dict[str, Any]:
    """A key as its audit records show it (never the secret or its hash)."""
    out: dict[str, Any] = {
        "key_id": info.key_id,
        "name": info.name,
        "role": info.role.value,
        "created_by": info.created_by,
        "revoked_at": info.revoked_at,
        "expires_at": info.expires_at,
    }
    if info.role is Role.SIDECAR:
        out["tenants"] = list(info.tenants)
        out["pools"] = list(info.pools)
    return out


class KeyStore:
    """API keys in the database. ``create``/``revoke`` take an open session so
    the caller can write the audit record in the same transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @staticmethod
    def create(
        s: Session,
        name: str,
        role: Role,
        created_by: str,
        *,
        tenants: Sequence[str] = (),
        pools: Sequence[str] = (),
        expires_at: datetime | None = None,
    ) -> tuple[str, KeyInfo]:
        """A sidecar key names the tenants and pools it serves (``*`` = all);
        ``expires_at`` (any role) must be in the future."""
        name = name.strip()
        if not name:
            raise InvalidArgument("name", "must not be empty")
        if len(name) > MAX_NAME_LEN or not name.isprintable():
            raise InvalidArgument("name", f"1..{MAX_NAME_LEN} printable characters")
        tenants, pools = key_scope(role, tenants, pools)
        check_expiry("expire_time", expires_at, datetime.now(UTC))
        key, key_id, salt, digest = new_key()
        row = ApiKey(
            key_id=key_id,
            name=name,
            role=role.value,
            salt=salt,
            secret_hash=digest,
            created_by=created_by[:256],
            tenants=json.dumps(tenants) if role is Role.SIDECAR else None,
            pools=json.dumps(pools) if role is Role.SIDECAR else None,
            expires_at=expires_at,
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

    def create_key(
        self,
        name: str,
        role: Role,
        actor: Actor | None = None,
        *,
        tenants: Sequence[str] = (),
        pools: Sequence[str] = (),
        expires_at: datetime | None = None,
    ) -> tuple[str, KeyInfo]:
        """Create a key, audited (with its scope and expiry); returns (the
        key to show once, its info)."""
        actor = actor or local_actor()
        with Session(self.engine) as s, s.begin():
            key, info = self.create(
                s, name, role, actor.name, tenants=tenants, pools=pools, expires_at=expires_at
            )
            log_change(s, actor, "key.create", f"key:{info.key_id}", None, key_dict(info))
        return key, info

    def revoke_key(self, key_id: str, actor: Actor | None = None) -> KeyInfo:
        """Revoke a key, audited (revoking twice changes nothing)."""
        actor = actor or local_actor()
        with Session(self.engine) as s, s.begin():
            before, after = self.revoke(s, key_id)
            if before != after:
                log_change(
                    s, actor, "key.revoke", f"key:{key_id}", key_dict(before), key_dict(after)
                )
        return after

    def list(self, *, include_revoked: bool = True) -> list[KeyInfo]:
        with Session(self.engine) as s:
            q = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
            if not include_revoked:
                q = q.where(ApiKey.revoked_at.is_(None))
            return [_info(r) for r in s.scalars(q)]

    def touch_last_used(self, key_ids: Collection[str], at: datetime) -> None:
        """Record that these keys were used at ``at`` (the server's flush of
        its in-memory record, once per config poll). ``updated_at`` is left
        alone: it is what tells servers to reload their keys."""
        ids = sorted(key_ids)
        with Session(self.engine) as s, s.begin():
            for i in range(0, len(ids), TOUCH_CHUNK):
                s.execute(
                    update(ApiKey)
                    .where(
                        ApiKey.key_id.in_(ids[i : i + TOUCH_CHUNK]),
                        or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < at),
                    )
                    # named, so that the column's onupdate does not bump it
                    .values(last_used_at=at, updated_at=ApiKey.updated_at)
                    .execution_options(synchronize_session=False)
                )

    def fingerprint(self) -> tuple[object, ...]:
        with Session(self.engine) as s:
            return tuple(
                s.execute(select(func.count(ApiKey.id), func.max(ApiKey.updated_at))).one()
            )

    def verifiers(self) -> dict[str, KeyVerifier]:
        with Session(self.engine) as s:
            return {r.key_id: _verifier(r) for r in s.scalars(select(ApiKey))}
