"""Integer arguments of the pure-Python references (``_buckets_py``, ``_sched_py``,
``_reqlog_py``).

They convert each argument as their compiled twins do, with ``operator.index``
(``TypeError`` for floats and other non-integers) and then the int64 range
(``OverflowError`` outside it), and validate it with a ``ValueError`` that names it.
"""

from __future__ import annotations

from operator import index
from typing import Final

I64_MIN: Final = -(2**63)
I64_MAX: Final = 2**63 - 1


def i64(value: int) -> int:
    """``value`` as a plain int, failing like a C ``long long`` parameter would."""
    v = index(value)
    if not I64_MIN <= v <= I64_MAX:
        raise OverflowError(f"{v} does not fit in a signed 64-bit integer")
    return v


def check_range(name: str, value: int, low: int, high: int) -> None:
    """``ValueError`` naming ``name`` unless ``low <= value <= high``."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
