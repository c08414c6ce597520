"""The ledger export's choices and period bounds, as plain types and pure
parsing: the CLI lists the choices in ``--help`` and reads ``--from`` and
``--to`` without importing the exporter (and SQLAlchemy with it)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum

from controlplane.domain.errors import InvalidArgument, excerpt

# Period bounds: the ledger's times are Unix nanoseconds in BIGINT columns,
# so a bound outside [1970, 2262] cannot even be compared in SQL.
MAX_TIME_NS = 2**63 - 1
TIME_RANGE_TEXT = "1970-01-01 and 2262-04-11T23:47:16Z (Unix nanoseconds in 64 bits)"


class ExportFormat(StrEnum):
    CSV = "csv"
    JSONL = "jsonl"
    PARQUET = "parquet"


class Granularity(StrEnum):
    REQUEST = "request"  # one row per record
    DAILY = "daily"  # per tenant, model and UTC day


def check_time_ns(field_name: str, ns: int) -> int:
    """A period bound: Unix ns in the ledger's 64-bit columns."""
    if not 0 <= ns <= MAX_TIME_NS:
        raise InvalidArgument(field_name, f"must be between {TIME_RANGE_TEXT}")
    return ns


def parse_when(field_name: str, text: str) -> int:
    """ISO 8601 date or time (naive = UTC) or Unix seconds -> Unix ns, within
    the range the ledger stores (``check_time_ns``)."""
    text = text.strip()
    try:
        if text.replace(".", "", 1).isdigit():
            return check_time_ns(field_name, int(Decimal(text) * 1_000_000_000))
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(
            field_name, f"not an ISO 8601 time or Unix seconds: {excerpt(text)}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    ns = (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
    return check_time_ns(field_name, ns)
