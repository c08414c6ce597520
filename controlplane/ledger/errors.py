"""Metering's domain errors; controlplane/rpc/errors.py maps them."""

from __future__ import annotations

from controlplane.errors import DomainError


class LedgerUnavailable(DomainError):
    """The ledger cannot make a record durable (database unreachable and the
    spool full) or cannot be consulted; nothing was changed, retry later.
    Mapped to gRPC UNAVAILABLE."""
