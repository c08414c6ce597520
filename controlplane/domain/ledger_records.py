"""One ledger row: both ledgers of one settled request.

Timestamps are integer nanoseconds since the Unix epoch (UTC): exact,
portable and cheap to COPY; exports write them as ISO 8601. Amounts are
integer nano-units of ``currency`` (see ``money``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from controlplane.domain import MAX_ID_LEN

Key = tuple[str, str]  # (tenant_id, request_id)

# Keys a record is tried under when its request id is in the ledger for
# another admission: ``<id>#<reservation_id>``, then ``.2``, ``.3`` ...
REBOOK_KEYS = 4


def rebooked_id(request_id: str, reservation_id: int, n: int = 1) -> str:
    """The ledger key of an admission whose request id is in the ledger
    already for another admission: ``<id>#<reservation_id>`` (``.<n>``
    after, n > 1), the id cut to keep it within MAX_ID_LEN. Deterministic:
    a repeated Complete of the same admission arrives at the same key."""
    suffix = f"#{reservation_id}" + (f".{n}" if n > 1 else "")
    return request_id[: MAX_ID_LEN - len(suffix)] + suffix


class LedgerRecord(NamedTuple):
    tenant_id: str
    request_id: str
    reservation_id: int
    lane: str
    model: str
    pool: str
    arrival_ns: int  # the Admit reached the plane
    queue_start_ns: int  # = arrival (requests queue from the moment they arrive)
    exec_start_ns: int  # reported by the sidecar, else the admission time
    end_ns: int  # reported by the sidecar, else when the Complete arrived
    settled_ns: int  # when the plane settled it: the ledger's time axis
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reserved_tokens: int
    kv_cache_miss_rate: Decimal  # 6 decimals
    miss_rate_source: str  # request | window | none
    pricing_multiplier: Decimal  # locked at admission
    pricing_window: int  # the window's start, Unix seconds (0 = flat pricing)
    lane_multiplier: Decimal
    currency: str
    user_charge_nanos: int
    actual_cost_nanos: int
    price_id: int  # the catalog entry used (0 = none: priced at zero)
    # The caller's own id for the request (the HTTP sidecar: the client's
    # x-request-id), for correlation only; None = none given. Last, with a
    # default: spool rows written before it have one value less.
    correlation_id: str | None = None

    @property
    def key(self) -> Key:
        return (self.tenant_id, self.request_id)


COLUMNS: tuple[str, ...] = LedgerRecord._fields
DECIMAL_FIELDS = frozenset({"kv_cache_miss_rate", "pricing_multiplier", "lane_multiplier"})
_DECIMAL_INDEXES = tuple(i for i, c in enumerate(COLUMNS) if c in DECIMAL_FIELDS)


def to_json_row(r: LedgerRecord) -> list[Any]:
    """JSON-safe list (Decimals as text) for the spool."""
    out: list[Any] = list(r)
    for i in _DECIMAL_INDEXES:
        out[i] = str(out[i])
    return out


def from_json_row(row: list[Any]) -> LedgerRecord:
    values = list(row)
    for i in _DECIMAL_INDEXES:
        values[i] = Decimal(values[i])
    return LedgerRecord(*values)


def from_db_row(row: Any) -> LedgerRecord:
    """A row read back through SQLAlchemy (Numeric -> Decimal already)."""
    values = list(row)
    for i in _DECIMAL_INDEXES:
        values[i] = Decimal(values[i])
    if values[COLUMNS.index("price_id")] is None:
        values[COLUMNS.index("price_id")] = 0
    return LedgerRecord(*values)


def iso_ns(ns: int) -> str:
    """``2026-11-29T12:00:00.123456789Z``: ISO 8601, UTC, nanoseconds."""
    secs, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"
