"""Pricing-window writes fenced by the cell's lease epoch (docs/ha.md,
"Fenced writes").

A pool's pricing windows have one writer: the owner of the pool's cell.
Metering is given a ``Fencing`` function, pool -> this replica's lease of
the pool's cell:

- ``(cell, epoch)``: owned; each write of the pool's rows runs
  ``controlplane.store.leases.fence(conn, cell, epoch)`` in its own transaction
  first, so a takeover (which raises the epoch) either waits for the write
  or makes it fail with ``StaleEpoch`` and roll back;
- ``None``: not owned here; the rows are not written;
- ``UNFENCED``: one replica (SQLite, or no scale-out): written as always.

"Not owned" and "unfenced" are different answers on purpose: a replica that
lost a cell must not fall back to unfenced writes.

The token is read when the rows are taken from the book (on the event loop),
not when the thread writes them, so rows built under an old lease are never
written under a newer one. A refused or unowned pool's in-memory windows are
dropped (another replica continues them from the database); a pool whose
lease changed to a newer epoch meanwhile keeps its (rebuilt) state.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import structlog

from controlplane.domain.pricing import WindowSummary
from controlplane.ha import trace
from controlplane.ledger.pricing import PricingBook
from controlplane.store.leases import StaleEpoch
from controlplane.store.ledger import LedgerStore

log = structlog.get_logger("burstgate.ledger")

WINDOWS_TABLE = "pricing_windows"


class Unfenced(Enum):
    """The answer of a ``Fencing`` for a replica that writes unfenced."""

    UNFENCED = "unfenced"


UNFENCED = Unfenced.UNFENCED
FenceToken = tuple[str, int]  # (cell, epoch)
Fencing = Callable[[str], FenceToken | Unfenced | None]


def no_fencing(pool: str) -> Unfenced:
    """The default ``Fencing``: one replica, nothing to fence."""
    return UNFENCED


class StaleWrites:
    """``burstgate_ha_stale_writes_total{table}``: rows refused because this
    replica's lease was superseded (``StaleEpoch``) or gone, with at most one
    log line per ``log_every_s``."""

    def __init__(
        self, log_every_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.by_table: Counter[str] = Counter()
        self._log_every_s = log_every_s
        self._clock = clock
        self._last_log: float | None = None
        self._unlogged = 0

    def count(self, table: str, rows: int, cell: str, reason: str) -> None:
        self.by_table[table] += rows
        self._unlogged += rows
        now = self._clock()
        if self._last_log is None or now - self._last_log >= self._log_every_s:
            log.warning(
                "fenced write refused: this replica no longer owns the cell",
                table=table,
                cell=cell,
                reason=reason,
                rows_refused_since_last_line=self._unlogged,
            )
            self._last_log, self._unlogged = now, 0


@dataclass
class Batch:
    """Rows written in one transaction, under one token."""

    token: FenceToken | Unfenced
    rows: list[WindowSummary] = field(default_factory=list)


@dataclass
class WriteResult:
    refused: list[tuple[Batch, StaleEpoch]] = field(default_factory=list)
    failed: list[Batch] = field(default_factory=list)  # not written (database error)
    error: Exception | None = None


def _trace(ev: str, fence: FenceToken | None, begin_ns: int, rows: int) -> None:
    """A fenced write's outcome in the ownership trace, when it is on
    (controlplane/ha/trace.py): the stale-write check of the acceptance
    harness compares ``begin_ns`` with the start of the cell's next epoch."""
    if fence is not None and (sink := trace.SINK) is not None:
        sink.write(ev, cell=fence[0], epoch=fence[1], begin_ns=begin_ns,
                   done_ns=time.monotonic_ns(), rows=rows)  # fmt: skip


class WindowWriter:
    """Plans (on the loop), writes (in a thread) and settles (on the loop)
    one flush of pricing windows."""

    def __init__(
        self, store: LedgerStore, book: PricingBook, fencing: Fencing, stale: StaleWrites
    ) -> None:
        self.store = store
        self.book = book
        self.fencing = fencing
        self.stale = stale
        # Pools whose windows are being reloaded (a takeover): not written
        # until the stored rows are installed.
        self.rebuilding: set[str] = set()
        # The lease each pool's windows were rebuilt under (``installed``):
        # the only lease its rows are written under.
        self._owned: dict[str, FenceToken] = {}

    def plan(self, rows: Sequence[WindowSummary]) -> list[Batch]:
        """Group rows by the lease they may be written under (one batch per
        cell). A pool's rows are written under a lease only once its windows
        were rebuilt under that same lease (``installed``); rows of pools
        not owned here, or owned under a lease they were not rebuilt for,
        are dropped with their windows."""
        batches: dict[FenceToken | Unfenced, Batch] = {}
        unowned: dict[str, tuple[int, str]] = {}  # pool -> rows, why
        for w in rows:
            if w.pool in self.rebuilding:
                continue  # install() replaces this pool's windows
            token = self.fencing(w.pool)
            if token is not None and (token is UNFENCED or self._owned.get(w.pool) == token):
                batches.setdefault(token, Batch(token)).rows.append(w)
                continue
            n = unowned.get(w.pool, (0, ""))[0]
            unowned[w.pool] = (n + 1, "lease lost" if token is None else "lease not rebuilt")
        for pool, (n, why) in unowned.items():
            held = self._owned.pop(pool, None)
            if held is not None:  # rows built under a lease that is gone
                self.stale.count(WINDOWS_TABLE, n, held[0], why)
        self.book.drop_pools(unowned)
        return list(batches.values())

    def write(self, batches: Sequence[Batch]) -> WriteResult:
        """Each batch in its own transaction, fenced by its token (blocking)."""
        result = WriteResult()
        for i, batch in enumerate(batches):
            fence = None if batch.token is UNFENCED else batch.token
            assert not isinstance(fence, Unfenced)
            begin = time.monotonic_ns()
            try:
                self.store.save_windows(batch.rows, fence)
            except StaleEpoch as exc:
                result.refused.append((batch, exc))
                _trace("window_refused", fence, begin, len(batch.rows))
            except Exception as exc:
                result.failed = list(batches[i:])
                result.error = exc
                break
            else:
                _trace("window_write", fence, begin, len(batch.rows))
        return result

    def settle(self, result: WriteResult) -> list[WindowSummary]:
        """After ``write``: count and drop what the lease refused; the closed
        rows of failed batches whose lease is still the same, to retry."""
        for batch, exc in result.refused:
            assert not isinstance(batch.token, Unfenced)
            self.stale.count(WINDOWS_TABLE, len(batch.rows), exc.cell, "stale epoch")
            pools = {w.pool for w in batch.rows}
            for p in pools:
                if self._owned.get(p) == batch.token:
                    del self._owned[p]
            # A pool re-acquired and rebuilt under a newer epoch meanwhile
            # keeps that state.
            self.book.drop_pools({p for p in pools if p not in self._owned})
        return [
            w
            for batch in result.failed
            for w in batch.rows
            if w.closed and self.fencing(w.pool) == batch.token
        ]

    def installed(self, pools: Iterable[str]) -> None:
        """``pools`` were rebuilt from the database under this replica's
        current lease: their rows are written under it from now on."""
        for p in pools:
            token = self.fencing(p)
            if isinstance(token, tuple):
                self._owned[p] = token
            else:
                self._owned.pop(p, None)

    def rebuilt_under(self, pool: str) -> FenceToken | None:
        """The lease ``pool``'s windows were rebuilt under (None: not yet)."""
        return self._owned.get(pool)

    def forget(self, pools: Iterable[str]) -> None:
        """``pools`` left this replica (``on_lost``): their windows are
        dropped, and rows of theirs are not written (nor counted as refused)."""
        gone = set(pools)
        for p in gone:
            self._owned.pop(p, None)
        self.book.drop_pools(gone)
