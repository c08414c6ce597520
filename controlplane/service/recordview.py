"""The named, read-only view of a remembered request that other packages
read (the ledger, the Envoy integration, the RPC layer, tests).

Inside the service a record is a positional tuple (``records.Record``): it
is what the fast path's request table stores and the batch path builds in
numpy columns, so its field order is private to ``service/``. A
``RecordView`` wraps one without copying it and names its fields, so a
reader outside the service never depends on an index."""

from __future__ import annotations

from controlplane.service import records as R


class RecordView:
    """One remembered request: its decision and, when admitted, its
    reservation and settlement. Read-only."""

    __slots__ = ("_rec",)

    def __init__(self, rec: R.Record) -> None:
        self._rec = rec

    @classmethod
    def of(cls, rec: R.Record) -> RecordView:
        return cls(rec)

    def __repr__(self) -> str:
        return f"RecordView(state={self.state}, reason={self.reason}, pool={self.pool!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordView) and other._rec == self._rec

    def __hash__(self) -> int:
        return hash(self._rec)

    @property
    def raw(self) -> R.Record:
        """The tuple itself, for the service's own parts only."""
        return self._rec

    @property
    def state(self) -> int:
        """``records.OPEN``, ``SETTLED`` or ``REJECTED``."""
        return int(self._rec[R.STATE])

    @property
    def is_open(self) -> bool:
        return bool(self._rec[R.STATE] == R.OPEN)

    @property
    def is_settled(self) -> bool:
        return bool(self._rec[R.STATE] == R.SETTLED)

    @property
    def is_refused(self) -> bool:
        return bool(self._rec[R.STATE] == R.REJECTED)

    @property
    def reason(self) -> int:
        return int(self._rec[R.REASON])

    @property
    def retry_ns(self) -> int:
        return int(self._rec[R.RETRY_NS])

    @property
    def reserved(self) -> int:
        return int(self._rec[R.RESERVED])

    @property
    def rid(self) -> int:
        """The reservation id (0 when refused)."""
        return int(self._rec[R.RID])

    @property
    def granted(self) -> int:
        """The granted max_tokens."""
        return int(self._rec[R.GRANTED])

    @property
    def lane(self) -> str:
        return str(self._rec[R.LANE])

    @property
    def slot(self) -> int:
        return int(self._rec[R.SLOT])

    @property
    def decided_ns(self) -> int:
        return int(self._rec[R.DECIDED_NS])

    @property
    def arrived_ns(self) -> int:
        """When the Admit reached the plane (before any queueing)."""
        return int(self._rec[R.ARRIVED_NS])

    @property
    def pool(self) -> str:
        return str(self._rec[R.POOL])

    @property
    def model(self) -> str:
        return str(self._rec[R.MODEL])

    @property
    def multiplier(self) -> float:
        """The pricing multiplier locked at admission."""
        return float(self._rec[R.MULTIPLIER])

    @property
    def window(self) -> int:
        """The pricing window id."""
        return int(self._rec[R.WINDOW])

    @property
    def actual(self) -> int:
        """Settled: the actual tokens (-1 while open)."""
        return int(self._rec[R.ACTUAL])

    @property
    def refunded(self) -> int:
        return int(self._rec[R.REFUNDED])

    @property
    def shadow_reason(self) -> int:
        return int(self._rec[R.SHADOW_REASON])

    @property
    def degraded_cap(self) -> int:
        return int(self._rec[R.DEGRADED_CAP])

    @property
    def late(self) -> bool:
        """It could no longer meet its deadline when refused."""
        return bool(self._rec[R.SHED] & R.LATE_BIT)
