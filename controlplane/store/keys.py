"""API keys in the database (the SQL half of the key model; the key format,
roles and hashing are in ``controlplane.domain.keys``). ``create_key`` and
``revoke_key`` write the change and its audit record in one transaction."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from controlplane.domain.audit import Actor
from controlplane.domain.errors import InvalidArgument, NotFound
from controlplane.domain.keys import (
    MAX_NAME_LEN,
    KeyInfo,
    KeyVerifier,
    Principal,
    Role,
    new_key,
)
from controlplane.store.audit import local_actor, log_change
from controlplane.store.models import ApiKey


def _verifier(row: ApiKey) -> KeyVerifier:
    return KeyVerifier(
        bytes.fromhex(row.salt),
        row.secret_hash,
        Principal(row.key_id, row.name, Role(row.role)),
        row.revoked_at is not None,
    )


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        row.key_id, row.name, Role(row.role), row.created_by, row.created_at, row.revoked_at
    )


def key_dict(info: KeyInfo) -> dict[str, Any]:
    return {
        "key_id": info.key_id,
        "name": info.name,
        "role": info.role.value,
        "created_by": info.created_by,
        "revoked_at": info.revoked_at,
    }


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

    def create_key(self, name: str, role: Role, actor: Actor | None = None) -> tuple[str, KeyInfo]:
        """Create a key, audited; returns (the key to show once, its info)."""
        actor = actor or local_actor()
        with Session(self.engine) as s, s.begin():
            key, info = self.create(s, name, role, actor.name)
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

    def fingerprint(self) -> tuple[object, ...]:
        with Session(self.engine) as s:
            return tuple(
                s.execute(select(func.count(ApiKey.id), func.max(ApiKey.updated_at))).one()
            )

    def verifiers(self) -> dict[str, KeyVerifier]:
        with Session(self.engine) as s:
            return {r.key_id: _verifier(r) for r in s.scalars(select(ApiKey))}
