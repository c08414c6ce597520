"""Members and cell leases in PostgreSQL, and the fencing guard (the SQL of
scale-out's cell ownership; ``controlplane/ha`` is the use case over it).

Every operation is one statement or one short transaction, and every expiry
is judged by the DATABASE's clock (``clock_timestamp()``): the replicas'
wall clocks never meet, so their skew does not matter (their clock *rate*
does, for self-fencing: docs/ha.md, "Self-fencing").

The lease row's ``epoch`` is the fencing token: every acquisition raises it
by one, nothing lowers it. A write that must come from the cell's owner
alone runs ``fence(conn, cell, epoch)`` first, in its own transaction: the
row is share-locked until that transaction ends, so a takeover (an UPDATE of
the row) waits for the write to commit or roll back, and a write carrying a
superseded epoch is refused (``StaleEpoch``) and rolled back.

No advisory locks: they carry no token to fence a late writer with, live as
long as a session (broken by transaction-pooling proxies, held by a
half-dead connection) and are no-ops on CockroachDB.

PostgreSQL only: replicas meet in a shared database. On SQLite the
one-replica file lock (``controlplane.store.replica_lock``) stays, and
``HaStore`` refuses to be made (``HaUnsupported``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine, text

from controlplane.store.notify import LEASES_CHANNEL


class HaUnsupported(RuntimeError):
    """Scale-out asked of a database that cannot coordinate replicas."""


class StaleEpoch(RuntimeError):
    """A fenced write carried an epoch that is no longer the cell's lease."""

    def __init__(self, cell: str, epoch: int, current: int | None) -> None:
        self.cell, self.epoch, self.current = cell, epoch, current
        now = "has no lease row" if current is None else f"is at epoch {current}"
        super().__init__(
            f"cell {cell!r}: write fenced with epoch {epoch}, but the cell {now}; "
            "another replica owns it now, the write is refused"
        )


@dataclass(frozen=True)
class CellOwner:
    """A cell's lease as the database sees it (``owners()``)."""

    owner: str | None
    epoch: int
    expires_at: datetime | None
    address: str | None  # the owner's, from its member row (None: not a member now)
    expired: bool  # by the database's clock, when it was read


def require_postgres(dialect: str, what: str) -> None:
    if dialect != "postgresql":
        raise HaUnsupported(
            f"{what}: scale-out needs a shared PostgreSQL database, not {dialect}; "
            "on SQLite one replica serves a database (its replica lock). See docs/ha.md"
        )


def positive_ttl(ttl_s: float, name: str = "ttl") -> float:
    if not ttl_s > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0 seconds, got {ttl_s!r}")
    return float(ttl_s)


_ACQUIRE_INSERT = text(
    "INSERT INTO ha_cell_leases (cell_id, epoch) VALUES (:cell, 0) ON CONFLICT (cell_id) DO NOTHING"
)
# Free (never owned, or released), expired by the database's clock, or still
# ours (we lost the answer to an earlier acquire, or let our own lease lapse
# locally): raising the epoch then fences anything sent under the old one.
_ACQUIRE = text(
    "UPDATE ha_cell_leases SET owner = :me, epoch = epoch + 1,"
    " expires_at = clock_timestamp() + :ttl * interval '1 second',"
    " acquired_at = clock_timestamp()"
    " WHERE cell_id = :cell"
    " AND (owner IS NULL OR owner = :me OR expires_at < clock_timestamp())"
    " RETURNING epoch"
)
_RENEW = text(
    "UPDATE ha_cell_leases SET expires_at = clock_timestamp() + :ttl * interval '1 second'"
    " WHERE cell_id = :cell AND owner = :me AND epoch = :epoch"
    " AND expires_at > clock_timestamp()"
)
_RELEASE = text(
    "UPDATE ha_cell_leases SET owner = NULL, expires_at = clock_timestamp()"
    " WHERE cell_id = :cell AND owner = :me AND epoch = :epoch"
)
_RELEASE_MANY = text(
    "UPDATE ha_cell_leases SET owner = NULL, expires_at = clock_timestamp()"
    " WHERE owner = :me AND (cell_id, epoch) IN"
    " (SELECT * FROM unnest(CAST(:cells AS text[]), CAST(:epochs AS bigint[])))"
    " RETURNING cell_id"
)
# A released cell is announced in the release's transaction (heard only if
# it commits): the member it is now assigned to wakes and takes it at once
# instead of at its next tick (controlplane/store/notify.py). One
# notification per cell keeps every payload far below PostgreSQL's 8000 bytes.
_NOTIFY_RELEASED = text(
    f"SELECT pg_notify('{LEASES_CHANNEL}', c) FROM unnest(CAST(:cells AS text[])) AS c"
)
_HEARTBEAT = text(
    "INSERT INTO ha_members (member_id, address, started_at, heartbeat_at, draining)"
    " VALUES (:me, :address, clock_timestamp(), clock_timestamp(), :draining)"
    " ON CONFLICT (member_id) DO UPDATE SET address = excluded.address,"
    " heartbeat_at = excluded.heartbeat_at, draining = excluded.draining"
)
_LIVE_ADDRESSES = text(
    "SELECT member_id, address FROM ha_members WHERE NOT draining"
    " AND heartbeat_at > clock_timestamp() - :ttl * interval '1 second'"
    " ORDER BY member_id"
)
_OWNERS = text(
    "SELECT l.cell_id, l.owner, l.epoch, l.expires_at, m.address,"
    " (l.owner IS NULL OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp())"
    " FROM ha_cell_leases l LEFT JOIN ha_members m ON m.member_id = l.owner"
    " ORDER BY l.cell_id"
)
# FOR SHARE, not FOR KEY SHARE: the weaker lock does not conflict with an
# UPDATE that leaves the key alone, which is exactly what a takeover is.
_FENCE = text("SELECT epoch FROM ha_cell_leases WHERE cell_id = :cell FOR SHARE")


class HaStore:
    """The member and lease tables over the project's engine (blocking calls;
    the coordinator runs them on a thread)."""

    def __init__(self, engine: Engine) -> None:
        require_postgres(engine.dialect.name, "HaStore")
        self.engine = engine

    # --- members ---

    def heartbeat(self, member_id: str, address: str, draining: bool = False) -> None:
        """Insert or refresh this member's row (``started_at`` kept)."""
        with self.engine.begin() as conn:
            conn.execute(_HEARTBEAT, {"me": member_id, "address": address, "draining": draining})

    def live_members(self, member_ttl_s: float) -> list[str]:
        """Members not draining that heartbeat within ``member_ttl_s``, sorted."""
        return list(self.live_addresses(member_ttl_s))

    def live_addresses(self, member_ttl_s: float) -> dict[str, str]:
        """``live_members`` with their addresses (owner discovery)."""
        with self.engine.begin() as conn:
            rows = conn.execute(_LIVE_ADDRESSES, {"ttl": positive_ttl(member_ttl_s, "member_ttl")})
            return {m: a for m, a in rows}

    def leave(self, member_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("DELETE FROM ha_members WHERE member_id = :me"), {"me": member_id})

    # --- leases ---

    def acquire(self, cell: str, me: str, ttl_s: float) -> int | None:
        """Take ``cell`` for ``ttl_s`` seconds of database time if it is free,
        expired or already ours; the new epoch, or None when another member
        holds it. Waits for fenced transactions of the cell to end."""
        ttl = positive_ttl(ttl_s)
        with self.engine.begin() as conn:
            conn.execute(_ACQUIRE_INSERT, {"cell": cell})
            row = conn.execute(_ACQUIRE, {"cell": cell, "me": me, "ttl": ttl}).first()
            return None if row is None else int(row[0])

    def renew(self, cell: str, me: str, epoch: int, ttl_s: float) -> bool:
        """Extend our unexpired lease of ``epoch`` to now + ``ttl_s`` (database
        time); False when it is not ours any more or already expired."""
        ttl = positive_ttl(ttl_s)
        with self.engine.begin() as conn:
            res = conn.execute(_RENEW, {"cell": cell, "me": me, "epoch": epoch, "ttl": ttl})
            return bool(res.rowcount)

    def release(self, cell: str, me: str, epoch: int) -> bool:
        """Give the cell up at once (a graceful handoff); only our own lease of
        ``epoch``. The epoch stays: the next acquire raises it. Announced on
        ``burstgate_leases`` (the cell id) when released."""
        with self.engine.begin() as conn:
            res = conn.execute(_RELEASE, {"cell": cell, "me": me, "epoch": epoch})
            if res.rowcount:
                conn.execute(_NOTIFY_RELEASED, {"cells": [cell]})
            return bool(res.rowcount)

    def release_many(self, me: str, leases: dict[str, int]) -> int:
        """Give up several cells in one statement (``drain``): cell -> epoch;
        the number released (each announced on ``burstgate_leases``)."""
        if not leases:
            return 0
        cells = list(leases)
        with self.engine.begin() as conn:
            released = conn.execute(
                _RELEASE_MANY, {"me": me, "cells": cells, "epochs": [leases[c] for c in cells]}
            ).scalars().all()
            if released:
                conn.execute(_NOTIFY_RELEASED, {"cells": list(released)})
            return len(released)

    def owners(self) -> dict[str, CellOwner]:
        """Every cell's lease, with its owner's address (owner discovery)."""
        with self.engine.begin() as conn:
            return {
                cell: CellOwner(owner, int(epoch), expires, address, bool(expired))
                for cell, owner, epoch, expires, address, expired in conn.execute(_OWNERS)
            }


def fence(conn: Connection, cell: str, epoch: int) -> None:
    """Guard a single-writer write: inside the caller's transaction, share-lock
    the cell's lease row and check that ``epoch`` is still its epoch, else
    raise ``StaleEpoch`` (the caller's transaction is then rolled back by
    its ``with engine.begin()``). The lock holds until the transaction ends,
    so a takeover cannot slip in between this check and the write."""
    require_postgres(conn.dialect.name, "fence")
    row = conn.execute(_FENCE, {"cell": cell}).first()
    current = None if row is None else int(row[0])
    if current != epoch:
        raise StaleEpoch(cell, epoch, current)
