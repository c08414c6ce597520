"""The API's edge rules, checked by the client before anything is sent.

The server checks every request at its edge (``controlplane/domain/validate.py``)
and answers INVALID_ARGUMENT naming the field. A client checks first because
an AdmitStream batch with one bad entry ends the whole stream on the server,
failing every other caller's entry sharing it. These are the same bounds and
the same messages; tests/unit/test_client_edge.py compares the two on random
values, so neither side can move alone.
"""

from __future__ import annotations

from burstgate_client.errors import InvalidArgument

MAX_ID_LEN = 128  # tenant_id, request_id, retry_key, correlation_id
MAX_MODEL_LEN = 256
MAX_LANE_NAME = 32
MAX_POOL_LEN = 128  # engine pool names (AdmitRequest.pool, LoadReport.pool)
MAX_TOKENS_PER_FIELD = 10_000_000


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
