"""Edge validation shared by the unary and batched paths. Each failure names
the field (and the index inside a batch) so a sidecar author can fix it."""

from __future__ import annotations

from controlplane.domain import MAX_ID_LEN, MAX_MODEL_LEN, MAX_TOKENS_PER_FIELD
from controlplane.domain.errors import InvalidArgument


def check_id(field: str, value: str, *, max_len: int = MAX_ID_LEN) -> None:
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > max_len:
        raise InvalidArgument(field, f"longer than {max_len} characters ({len(value)})")
    if not value.isprintable():
        raise InvalidArgument(field, "must not contain control characters")


def check_optional_name(field: str, value: str, *, max_len: int = MAX_MODEL_LEN) -> None:
    if len(value) > max_len:
        raise InvalidArgument(field, f"longer than {max_len} characters ({len(value)})")
    if value and not value.isprintable():
        raise InvalidArgument(field, "must not contain control characters")


def check_tokens(field: str, value: int) -> None:
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")
    if value > MAX_TOKENS_PER_FIELD:
        raise InvalidArgument(field, f"must be <= {MAX_TOKENS_PER_FIELD:,}, got {value}")


def check_fraction(field: str, value: float) -> None:
    # NaN fails both comparisons, so test the positive range.
    if not (0.0 <= value <= 1.0):
        raise InvalidArgument(field, f"must be between 0 and 1, got {value}")
