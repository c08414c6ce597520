# Stubs for the compiled module; they mirror fastpath/_reqlog_py.py exactly, and
# tests/unit/fastpath/test_fastpath_stubs.py checks them against the compiled module.
from collections.abc import Iterable
from typing import Final, Self, final

import numpy as np
import numpy.typing as npt

from fastpath._reqlog_py import Row

__all__ = ["NF", "OPEN", "REJECTED", "SETTLED", "RequestTable"]

STATE: Final[int]
RETRY_NS: Final[int]
DECIDED_NS: Final[int]
ACTUAL: Final[int]
REFUNDED: Final[int]
NF: Final[int]
OPEN: Final[int]
SETTLED: Final[int]
REJECTED: Final[int]
COMPACT_SLACK: Final[int]
SLOT_BYTES: Final[int]
_NARROW: Final[dict[int, tuple[int, int]]]

def _siphash13(key0: int, key1: int, data: bytes) -> int: ...
def _siphash13_chunks(key0: int, key1: int, chunks: list[bytes]) -> int: ...

# A cdef class: @cython.final, and built by __cinit__ (so its constructor is __new__;
# object.__init__ takes nothing).
@final
class RequestTable:
    def __new__(cls, ttl_ns: int, replay_ns: int, settled_ns: int) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def open_count(self) -> int: ...
    @property
    def remembers_rejections(self) -> bool: ...
    @property
    def wide_rows(self) -> int: ...
    def _set_generation(self, tkey: int, tenant_id: str, request_id: str, gen: int) -> None: ...
    def _generation(self, tkey: int, tenant_id: str, request_id: str) -> int | None: ...
    def get(self, tkey: int, tenant_id: str, request_id: str) -> Row | None: ...
    def replay(self, tkey: int, tenant_id: str, request_id: str, now: int) -> Row | None: ...
    def replay_many(
        self,
        tkeys: npt.NDArray[np.int64],
        tenant_ids: list[str],
        request_ids: list[str],
        now: int,
    ) -> dict[int, Row]: ...
    def add(self, tkey: int, tenant_id: str, request_id: str, row: Row) -> None: ...
    def add_batch(
        self,
        tkeys: npt.NDArray[np.int64],
        tenant_ids: list[str],
        request_ids: list[str],
        rows: npt.NDArray[np.int64],
        fresh: npt.NDArray[np.int8] | None = None,
    ) -> None: ...
    def settle(
        self, tkey: int, tenant_id: str, request_id: str, actual: int, refunded: int, now: int
    ) -> Row: ...
    def drop_open(self, tkey: int, tenant_id: str, request_id: str) -> Row | None: ...
    def drop_open_where(self, column: int, values: Iterable[int]) -> list[Row]: ...
    def expire(self, now: int) -> list[Row]: ...
    def footprint(self) -> dict[str, int]: ...
