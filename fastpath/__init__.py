"""burstgate's hot path: per-tenant token buckets, hour/day quotas, concurrency counters.

Two builds with identical behaviour: the compiled ``fastpath._buckets_c`` (the default)
and the pure-Python reference ``fastpath._buckets_py``.  ``BURSTGATE_FASTPATH=python``
selects the reference on purpose; otherwise the compiled module must import, and there
is no silent fallback, so a missing build fails loudly.  ``IMPLEMENTATION`` says which
one is live (the service reports it).

The fastpath is pure: callers pass the time (``now_ns``) in; nothing here reads a clock,
logs or does I/O.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final, Literal

from fastpath.codes import Reason

__all__ = ["ENV_VAR", "IMPLEMENTATION", "Reason", "TokenBucketTable"]

ENV_VAR: Final = "BURSTGATE_FASTPATH"

_choice = os.environ.get(ENV_VAR, "")
if _choice not in ("", "cython", "python"):
    raise ValueError(
        f"{ENV_VAR} must be 'python' (pure-Python reference) or 'cython'/unset "
        f"(compiled, the default), got {_choice!r}"
    )

IMPLEMENTATION: Literal["cython", "python"]
# Type checkers always see the reference, whose signatures the compiled stub mirrors.
if TYPE_CHECKING or _choice == "python":
    from fastpath._buckets_py import TokenBucketTable

    IMPLEMENTATION = "python"
else:
    try:
        from fastpath._buckets_c import TokenBucketTable
    except ImportError as exc:
        raise ImportError(
            "burstgate's compiled fastpath (fastpath._buckets_c) is not built or failed to "
            f"load: {exc}. Build it with `pip install -e .` (needs Cython and a C compiler), "
            f"or set {ENV_VAR}=python to run the slower pure-Python reference on purpose."
        ) from exc
    IMPLEMENTATION = "cython"
