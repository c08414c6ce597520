# Stubs for the compiled module; they mirror fastpath/_sign_py.py.
from collections.abc import Callable, Sequence
from typing import Any, Final, final

__all__ = ["MAC_BYTES", "MacKey"]

MAC_BYTES: Final[int]

def _set_sha_ni(on: bool) -> bool: ...
@final
class MacKey:
    def __init__(self, block: bytes) -> None: ...
    def mac(self, data: bytes) -> bytes: ...
    def sign_rows(
        self,
        facts: Any,
        admitted: Sequence[int],
        n: int,
        tenant_ids: list[str],
        request_ids: list[str],
        names: Sequence[str],
        body_of: Callable[[int, int, int, int, int], bytes],
    ) -> list[bytes]: ...
