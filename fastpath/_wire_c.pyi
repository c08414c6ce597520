# Stubs for the compiled module; they mirror fastpath/_wire_py.py exactly, and
# tests/unit/fastpath/test_fastpath_stubs.py checks them against the compiled module.
from collections.abc import Sequence
from typing import Self, final

__all__ = ["AdmitBatchColumns", "WireError", "read_batch", "write_result"]

class WireError(ValueError): ...

# A cdef class: @cython.final, built by __cinit__ (so its constructor is __new__;
# object.__init__ takes nothing); its columns are C-level attributes.
@final
class AdmitBatchColumns:
    batch_id: int
    tenant_id: list[str]
    request_id: list[str]
    lane: list[str]
    prompt_tokens: list[int]
    max_tokens: list[int]
    model: str
    pool: str
    max_wait_ms: list[int]
    retry_key: list[str]
    attempt: list[int]
    def __new__(cls) -> Self: ...

def read_batch(data: bytes) -> AdmitBatchColumns: ...
def write_result(
    batch_id: int,
    decision: Sequence[int],
    reason: Sequence[int],
    retry_after_ms: Sequence[int],
    reserved_tokens: Sequence[int],
    reservation_id: Sequence[int],
    granted_max_tokens: Sequence[int],
    bucket_remaining: Sequence[int],
    hourly_remaining: Sequence[int],
    daily_remaining: Sequence[int],
    duplicate: Sequence[bool],
    shadow_reason: Sequence[int],
    degraded: Sequence[bool],
    degradation: tuple[bool, int, int, str] | None,
    pressure: tuple[float, int, int, bool] | None,
    pricing_multiplier: str,
    retryable: Sequence[bool],
    queued: Sequence[bool],
    entry: Sequence[int],
    queue_wait_ms: Sequence[int],
    fallback_model: Sequence[str],
    owner: Sequence[str],
    admission_token: Sequence[bytes],
) -> bytes: ...
