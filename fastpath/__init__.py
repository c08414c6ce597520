"""burstgate's hot path: token buckets, quotas and concurrency; backpressure and fair queueing;
the request table; the AdmitStream wire codec; admission-token MACs.

Five modules, each in two builds with identical behaviour: the token-bucket table
(compiled ``fastpath._buckets_c``, reference ``fastpath._buckets_py``), the scheduling
primitives (compiled ``fastpath._sched_c``, reference ``fastpath._sched_py``), the
request table (compiled ``fastpath._reqlog_c``, reference ``fastpath._reqlog_py``), the
AdmitBatch reader / AdmitBatchResult writer (compiled ``fastpath._wire_c``, reference
``fastpath._wire_py``) and the token MACs (compiled ``fastpath._sign_c``, reference
``fastpath._sign_py``).  The
compiled builds are the default.  ``BURSTGATE_FASTPATH=python`` selects all the references
on purpose; otherwise every compiled module must import, and there is no silent fallback
(not even for one of them), so a missing build fails loudly.  ``IMPLEMENTATION`` says
which builds are live, for all the modules at once (the service reports it).

The fastpath is pure: callers pass the time (``now_ns``) in; nothing here reads a clock,
logs or does I/O.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final, Literal

# Typed-dict shapes of FairQueue.snapshot(): plain dicts at run time, alike in both builds.
from fastpath._sched_py import FairQueueSnapshot, FlowState
from fastpath.codes import Reason

__all__ = [
    "ENV_VAR",
    "IMPLEMENTATION",
    "AdmitBatchColumns",
    "FairQueue",
    "FairQueueSnapshot",
    "FlowState",
    "MacKey",
    "Reason",
    "RequestTable",
    "TokenBucketTable",
    "WireError",
    "backpressure_retry_ns",
    "backpressure_score_ppm",
    "read_batch",
    "shed_threshold_ppm",
    "write_result",
]

ENV_VAR: Final = "BURSTGATE_FASTPATH"

_choice = os.environ.get(ENV_VAR, "")
if _choice not in ("", "cython", "python"):
    raise ValueError(
        f"{ENV_VAR} must be 'python' (pure-Python reference) or 'cython'/unset "
        f"(compiled, the default), got {_choice!r}"
    )

IMPLEMENTATION: Literal["cython", "python"]
# Type checkers always see the references, whose signatures the compiled stubs mirror.
if TYPE_CHECKING or _choice == "python":
    from fastpath._buckets_py import TokenBucketTable
    from fastpath._reqlog_py import RequestTable
    from fastpath._sched_py import (
        FairQueue,
        backpressure_retry_ns,
        backpressure_score_ppm,
        shed_threshold_ppm,
    )
    from fastpath._sign_py import MacKey
    from fastpath._wire_py import AdmitBatchColumns, WireError, read_batch, write_result

    IMPLEMENTATION = "python"
else:
    try:
        from fastpath._buckets_c import TokenBucketTable
        from fastpath._reqlog_c import RequestTable
        from fastpath._sched_c import (
            FairQueue,
            backpressure_retry_ns,
            backpressure_score_ppm,
            shed_threshold_ppm,
        )
        from fastpath._sign_c import MacKey
        from fastpath._wire_c import AdmitBatchColumns, WireError, read_batch, write_result
    except ImportError as exc:
        missing = exc.name or "fastpath._buckets_c/_sched_c/_reqlog_c/_wire_c/_sign_c"
        raise ImportError(
            f"burstgate's compiled fastpath ({missing}) "
            f"is not built or failed to load: {exc}. Build it with `pip install -e .` (needs "
            f"Cython and a C compiler), or set {ENV_VAR}=python to run the slower pure-Python "
            f"reference on purpose."
        ) from exc
    IMPLEMENTATION = "cython"
