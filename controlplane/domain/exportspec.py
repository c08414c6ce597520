"""The ledger export's choices, as plain types: the CLI lists them in
``--help`` without importing the exporter (and SQLAlchemy with it)."""

from __future__ import annotations

from enum import StrEnum


class ExportFormat(StrEnum):
    CSV = "csv"
    JSONL = "jsonl"
    PARQUET = "parquet"


class Granularity(StrEnum):
    REQUEST = "request"  # one row per record
    DAILY = "daily"  # per tenant, model and UTC day
