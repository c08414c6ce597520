"""SQL for metering: ledger rows (group commit), the price catalog, pricing
windows and margin warnings. Every method blocks; the server calls them in
worker threads, never on the event loop. How a batch of ledger rows is
written (binary COPY, SQLite executemany) is in ``store/ledger_write.py``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    Engine,
    Table,
    case,
    delete,
    func,
    select,
    tuple_,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from controlplane.domain.audit import Actor
from controlplane.domain.catalog import PRICE_FIELDS, PriceEntry, validate_entry
from controlplane.domain.ledger_records import COLUMNS, Key, LedgerRecord, from_db_row
from controlplane.domain.pricing import WindowSummary
from controlplane.store.audit import local_actor, log_change
from controlplane.store.leases import fence as check_epoch
from controlplane.store.ledger_write import pg_insert, sqlite_insert
from controlplane.store.models import (
    LedgerRecordRow,
    MarginWarningRow,
    PriceCatalogEntry,
    PricingWindowRow,
)

LEDGER: Table = LedgerRecordRow.__table__  # type: ignore[assignment]
CATALOG: Table = PriceCatalogEntry.__table__  # type: ignore[assignment]
WINDOWS: Table = PricingWindowRow.__table__  # type: ignore[assignment]
MARGINS: Table = MarginWarningRow.__table__  # type: ignore[assignment]

@dataclass(frozen=True, slots=True)
class TenantWindowSums:
    tenant_id: str
    currency: str
    requests: int
    user_charge_nanos: int
    actual_cost_nanos: int


@dataclass(frozen=True, slots=True)
class MarginWarning:
    tenant_id: str
    window_start: int
    window_s: int
    currency: str
    requests: int
    user_charge_nanos: int
    actual_cost_nanos: int
    ratio: Decimal
    recorded_ns: int


class LedgerStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"

    # ---------------------------------------------------------- ledger rows

    def insert(self, records: Sequence[LedgerRecord]) -> set[Key]:
        """Insert and commit ``records`` in one transaction; returns the keys
        that were already recorded (left as they were). The fast path is one
        COPY (PostgreSQL) or executemany (SQLite); only a batch that hits
        the primary key is redone conflict by conflict."""
        if not records:
            return set()
        raw = self.engine.raw_connection()
        try:
            if self.is_postgres:
                return pg_insert(raw.driver_connection, records)
            return sqlite_insert(raw.driver_connection, records)
        except BaseException:
            raw.invalidate()  # a connection that failed mid-write is not reused
            raise
        finally:
            raw.close()

    def fetch(self, key: Key) -> LedgerRecord | None:
        with self.engine.connect() as c:
            row = c.execute(
                select(*(LEDGER.c[name] for name in COLUMNS)).where(
                    LEDGER.c.tenant_id == key[0], LEDGER.c.request_id == key[1]
                )
            ).first()
        return None if row is None else from_db_row(row)

    def fetch_many(self, keys: Iterable[Key]) -> dict[Key, LedgerRecord]:
        wanted = list(keys)
        out: dict[Key, LedgerRecord] = {}
        with self.engine.connect() as c:
            for i in range(0, len(wanted), 500):
                chunk = wanted[i : i + 500]
                rows = c.execute(
                    select(*(LEDGER.c[name] for name in COLUMNS)).where(
                        tuple_(LEDGER.c.tenant_id, LEDGER.c.request_id).in_(chunk)
                    )
                )
                for row in rows:
                    rec = from_db_row(row)
                    out[rec.key] = rec
        return out

    def ping(self) -> None:
        with self.engine.connect() as c:
            c.execute(select(1)).scalar_one()

    def count(self) -> int:
        with self.engine.connect() as c:
            return int(c.execute(select(func.count()).select_from(LEDGER)).scalar_one())

    # --------------------------------------------------------- price catalog

    def catalog_fingerprint(self) -> tuple[Any, ...]:
        with self.engine.connect() as c:
            return tuple(
                c.execute(
                    select(
                        func.count(CATALOG.c.id),
                        func.max(CATALOG.c.updated_at),
                        func.sum(CATALOG.c.id),
                    )
                ).one()
            )

    def load_catalog(self) -> list[PriceEntry]:
        with self.engine.connect() as c:
            rows = c.execute(select(CATALOG).order_by(CATALOG.c.tenant_id, CATALOG.c.model)).all()
        return [_entry(r) for r in rows]

    def upsert_price(self, entry: PriceEntry, actor: Actor | None = None) -> PriceEntry:
        """Create or replace the entry of (tenant, model), audited in the same
        transaction (``price.set``; no record when nothing changed)."""
        validate_entry(entry)
        from controlplane.store.models import utcnow

        actor = actor or local_actor()
        values = {
            "tenant_id": entry.tenant_id,
            "model": entry.model,
            "currency": entry.currency,
            "input_per_mtok": entry.input_per_mtok,
            "cached_input_per_mtok": entry.cached_input_per_mtok,
            "output_per_mtok": entry.output_per_mtok,
            "gpu_prefill_per_mtok": entry.gpu_prefill_per_mtok,
            "gpu_decode_per_mtok": entry.gpu_decode_per_mtok,
            "gpu_overhead_per_request": entry.gpu_overhead_per_request,
            "lane_multipliers": entry.lane_multipliers_json(),
            "updated_at": utcnow(),
        }
        ins = (postgresql.insert if self.is_postgres else sqlite.insert)(CATALOG).values(values)
        stmt = ins.on_conflict_do_update(
            index_elements=["tenant_id", "model"],
            set_={k: v for k, v in values.items() if k not in ("tenant_id", "model")},
        )
        with Session(self.engine) as s, s.begin() as tx:
            before = self._price_row(s, entry.tenant_id, entry.model)
            s.execute(stmt)
            saved = self._price_row(s, entry.tenant_id, entry.model)
            assert saved is not None
            old = None if before is None else price_dict(before)
            new = price_dict(saved)
            if old == new:
                # Nothing changed but updated_at: keep the row as it was, so
                # that no change goes unaudited.
                tx.rollback()
                assert before is not None
                return before
            log_change(s, actor, "price.set", price_target(saved), old, new)
        return saved

    def delete_price(self, tenant_id: str, model: str, actor: Actor | None = None) -> bool:
        """Delete the entry of (tenant, model), audited in the same transaction
        (``price.delete``); False when there is none."""
        actor = actor or local_actor()
        with Session(self.engine) as s, s.begin():
            before = self._price_row(s, tenant_id, model)
            if before is None:
                return False
            s.execute(
                delete(CATALOG).where(CATALOG.c.tenant_id == tenant_id, CATALOG.c.model == model)
            )
            log_change(s, actor, "price.delete", price_target(before), price_dict(before), None)
        return True

    @staticmethod
    def _price_row(s: Session, tenant_id: str, model: str) -> PriceEntry | None:
        row = s.execute(
            select(CATALOG).where(CATALOG.c.tenant_id == tenant_id, CATALOG.c.model == model)
        ).first()
        return None if row is None else _entry(row)

    # -------------------------------------------------------- pricing windows

    def save_windows(
        self, rows: Sequence[WindowSummary], fence: tuple[str, int] | None = None
    ) -> None:
        """Upsert window rows (an open window is rewritten until it closes).
        ``fence`` = (cell, epoch): the rows are written only while that epoch
        is the cell's lease, checked in the same transaction
        (``controlplane.store.leases.fence``: ``StaleEpoch`` and nothing
        written otherwise). None: unfenced (one replica)."""
        if not rows:
            return
        values = [
            {
                "pool": w.pool,
                "model": w.model,
                "window_start": w.window_start_s,
                "window_s": w.window_s,
                "completions": w.completions,
                "completion_weight": w.completion_weight,
                "completion_weighted_ppm": w.completion_weighted_ppm,
                "load_reports": w.load_reports,
                "load_ppm_sum": w.load_ppm_sum,
                "miss_rate_ppm": w.miss_rate_ppm,
                "multiplier": w.multiplier,
                "next_multiplier": w.next_multiplier,
                "closed": w.closed,
            }
            for w in rows
        ]
        ins = (postgresql.insert if self.is_postgres else sqlite.insert)(WINDOWS)
        stmt = ins.on_conflict_do_update(
            index_elements=["pool", "model", "window_start"],
            set_={
                k: ins.excluded[k] for k in values[0] if k not in ("pool", "model", "window_start")
            },
        )
        with self.engine.begin() as c:
            if fence is not None:
                check_epoch(c, *fence)  # share-locks the lease row until commit
            c.execute(stmt, values)

    def load_windows(
        self,
        start_from: int,
        start_to: int | None = None,
        pool: str | None = None,
        pools: Sequence[str] | None = None,
    ) -> list[WindowSummary]:
        """Windows starting at or after ``start_from`` (and before
        ``start_to``), of ``pool`` or of ``pools`` when given."""
        q = select(WINDOWS).where(WINDOWS.c.window_start >= start_from)
        if start_to is not None:
            q = q.where(WINDOWS.c.window_start < start_to)
        if pool:
            q = q.where(WINDOWS.c.pool == pool)
        if pools is not None:
            q = q.where(WINDOWS.c.pool.in_(list(pools)))
        q = q.order_by(WINDOWS.c.window_start, WINDOWS.c.pool, WINDOWS.c.model)
        with self.engine.connect() as c:
            rows = c.execute(q).all()
        return [
            WindowSummary(
                r.pool,
                r.model,
                r.window_start,
                r.window_s,
                r.completions,
                r.completion_weight,
                r.completion_weighted_ppm,
                r.load_reports,
                r.load_ppm_sum,
                r.miss_rate_ppm,
                Decimal(r.multiplier),
                Decimal(r.next_multiplier),
                bool(r.closed),
            )
            for r in rows
        ]

    # ------------------------------------------------------- margin warnings

    def tenant_sums(
        self, start_ns: int, end_ns: int, tenants: Sequence[str] = ()
    ) -> list[TenantWindowSums]:
        """Both ledgers per tenant and currency over [start_ns, end_ns)."""
        q = (
            select(
                LEDGER.c.tenant_id,
                LEDGER.c.currency,
                func.count(),
                func.sum(LEDGER.c.user_charge_nanos),
                func.sum(LEDGER.c.actual_cost_nanos),
            )
            .where(LEDGER.c.settled_ns >= start_ns, LEDGER.c.settled_ns < end_ns)
            .group_by(LEDGER.c.tenant_id, LEDGER.c.currency)
            .order_by(LEDGER.c.tenant_id, LEDGER.c.currency)
        )
        if tenants:
            q = q.where(LEDGER.c.tenant_id.in_(list(tenants)))
        with self.engine.connect() as c:
            return [
                TenantWindowSums(t, cur, int(n), int(u or 0), int(a or 0))
                for t, cur, n, u, a in c.execute(q)
            ]

    def usage_by_pool(
        self, hour_start_ns: int, day_start_ns: int, pools: Sequence[str] | None = None
    ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """Tokens (prompt + output) settled per (tenant, pool) since
        ``hour_start_ns`` and since ``day_start_ns`` (the hour inside the
        day), of ``pools`` or of every pool: what quota counters are rebuilt
        from, at start and when a replica takes a cell over. One scan."""
        tokens = LEDGER.c.prompt_tokens + LEDGER.c.output_tokens
        q = (
            select(
                LEDGER.c.tenant_id,
                LEDGER.c.pool,
                func.sum(case((LEDGER.c.settled_ns >= hour_start_ns, tokens), else_=0)),
                func.sum(tokens),
            )
            .where(LEDGER.c.settled_ns >= min(day_start_ns, hour_start_ns))
            .group_by(LEDGER.c.tenant_id, LEDGER.c.pool)
        )
        if pools is not None:
            q = q.where(LEDGER.c.pool.in_(list(pools)))
        hour: dict[tuple[str, str], int] = {}
        day: dict[tuple[str, str], int] = {}
        with self.engine.connect() as c:
            for t, p, h, d in c.execute(q):
                if h:
                    hour[(t, p)] = int(h)
                if d:
                    day[(t, p)] = int(d)
        return hour, day

    def record_margin_warnings(self, warnings: Sequence[MarginWarning]) -> None:
        if not warnings:
            return
        values = [
            {
                "tenant_id": w.tenant_id,
                "window_start": w.window_start,
                "currency": w.currency,
                "window_s": w.window_s,
                "requests": w.requests,
                "user_charge_nanos": w.user_charge_nanos,
                "actual_cost_nanos": w.actual_cost_nanos,
                "ratio": w.ratio,
                "recorded_ns": w.recorded_ns,
            }
            for w in warnings
        ]
        ins = (postgresql.insert if self.is_postgres else sqlite.insert)(MARGINS)
        # Every replica checks every ended window (a warning is per tenant,
        # over all pools, derived from the ledger: no owner, not fenced); the
        # row computed from more records wins, whichever replica wrote last.
        stmt = ins.on_conflict_do_update(
            index_elements=["tenant_id", "window_start", "currency"],
            set_={
                k: ins.excluded[k]
                for k in values[0]
                if k not in ("tenant_id", "window_start", "currency")
            },
            where=MARGINS.c.requests <= ins.excluded.requests,
        )
        with self.engine.begin() as c:
            c.execute(stmt, values)

    def list_margin_warnings(
        self, start_s: int, end_s: int, tenants: Sequence[str] = (), limit: int = 1000
    ) -> list[MarginWarning]:
        q = select(MARGINS).where(MARGINS.c.window_start >= start_s, MARGINS.c.window_start < end_s)
        if tenants:
            q = q.where(MARGINS.c.tenant_id.in_(list(tenants)))
        q = q.order_by(MARGINS.c.window_start, MARGINS.c.tenant_id, MARGINS.c.currency).limit(limit)
        with self.engine.connect() as c:
            return [
                MarginWarning(
                    r.tenant_id,
                    r.window_start,
                    r.window_s,
                    r.currency,
                    r.requests,
                    r.user_charge_nanos,
                    r.actual_cost_nanos,
                    Decimal(r.ratio),
                    r.recorded_ns,
                )
                for r in c.execute(q)
            ]


def _entry(r: Any) -> PriceEntry:
    lanes = {k: Decimal(v) for k, v in json.loads(r.lane_multipliers or "{}").items()}
    return PriceEntry(
        tenant_id=r.tenant_id,
        model=r.model,
        currency=r.currency,
        input_per_mtok=Decimal(r.input_per_mtok),
        cached_input_per_mtok=Decimal(r.cached_input_per_mtok),
        output_per_mtok=Decimal(r.output_per_mtok),
        gpu_prefill_per_mtok=Decimal(r.gpu_prefill_per_mtok),
        gpu_decode_per_mtok=Decimal(r.gpu_decode_per_mtok),
        gpu_overhead_per_request=Decimal(r.gpu_overhead_per_request),
        lane_multipliers=lanes,
        id=int(r.id),
    )


def price_target(e: PriceEntry) -> str:
    """The audit log's target of a price entry: ``price:<tenant>/<model>``."""
    return f"price:{e.tenant_id}/{e.model}"


def price_dict(e: PriceEntry) -> dict[str, Any]:
    """A price entry as its audit record shows it (the row id left out)."""
    return {
        "currency": e.currency,
        **{name: getattr(e, name) for name in PRICE_FIELDS},
        "lane_multipliers": {k: str(v) for k, v in sorted(e.lane_multipliers.items())},
    }


def exceeds(actual_nanos: int, user_nanos: int, ratio: Decimal) -> bool:
    """actual > ratio x user, exactly."""
    return Decimal(actual_nanos) > ratio * Decimal(user_nanos)
