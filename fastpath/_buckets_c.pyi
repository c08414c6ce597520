# Stubs for the compiled module; they mirror fastpath/_buckets_py.py exactly.
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

Int64Array: TypeAlias = Buffer | npt.NDArray[np.int64]

AdmitResult = tuple[int, int, int, int, int, int]

def _c_constants() -> dict[str, int]: ...

class TokenBucketTable:
    def __init__(self, capacity: int = 64) -> None: ...
    @property
    def capacity(self) -> int: ...
    def configure(
        self,
        slot: int,
        now_ns: int,
        rate_mtok_per_s: int,
        burst_mtok: int,
        hourly_quota: int,
        daily_quota: int,
        max_concurrency: int,
        max_tokens_per_request: int,
    ) -> None: ...
    def is_configured(self, slot: int) -> bool: ...
    def remove(self, slot: int) -> None: ...
    def set_global_inflight_limit(self, tokens: int) -> None: ...
    def global_inflight_limit(self) -> int: ...
    def admit(self, slot: int, now_ns: int, prompt_tokens: int, max_tokens: int) -> AdmitResult: ...
    def charge(
        self, slot: int, now_ns: int, prompt_tokens: int, max_tokens: int
    ) -> AdmitResult: ...
    def admit_batch(
        self,
        now_ns: int,
        slots: Int64Array,
        prompt: Int64Array,
        max_tokens: Int64Array,
        out_reason: Int64Array,
        out_reserved: Int64Array,
        out_retry_ns: Int64Array,
        out_bucket_rem: Int64Array,
        out_hour_rem: Int64Array,
        out_day_rem: Int64Array,
        shadow: Int64Array | None = None,
    ) -> int: ...
    def settle(
        self,
        slot: int,
        now_ns: int,
        reserved_tokens: int,
        actual_tokens: int,
        admitted_ns: int,
    ) -> int: ...
    def release(self, slot: int, now_ns: int, reserved_tokens: int) -> None: ...
    def add_usage(self, slot: int, now_ns: int, hour_tokens: int, day_tokens: int) -> None: ...
    def level_mtok(self, slot: int, now_ns: int) -> int: ...
    def inflight(self, slot: int) -> int: ...
    def inflight_tokens(self, slot: int) -> int: ...
    def total_inflight_tokens(self) -> int: ...
    def snapshot(self, slot: int) -> dict[str, int]: ...
