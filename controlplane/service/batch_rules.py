"""What the batch's steps (batch.py) use of ``Decider``: its parts and the
rules a scalar decision uses, so both paths apply the same ones. A protocol,
so the twin does not import the decider that runs it."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from controlplane.service.answers import BatchResult
from controlplane.service.deadlines import Deadlines
from controlplane.service.gate import PoolGate
from controlplane.service.pressure import Verdict
from controlplane.service.pricing import Pricing
from controlplane.service.signing import AdmissionSigner
from controlplane.service.tenants import Tenant, TenantDirectory
from fastpath import TokenBucketTable


class Rules(Protocol):
    """What the steps use of ``Decider`` (service/decider.py): its parts and
    the rules a unary decision uses, so both paths apply the same ones."""

    table: TokenBucketTable
    tenants: TenantDirectory
    gate: PoolGate
    deadlines: Deadlines
    pricing: Pricing
    concurrency_retry_ns: int
    signer: AdmissionSigner

    def verdict(self, lane: str, pool: str, now: int) -> Verdict: ...

    def borrows(
        self, lane: str, slot: int, now: int, prompt: int, max_tokens: int, reason: int
    ) -> bool: ...

    def borrow(self, slot: int, now: int, prompt: int, max_tokens: int) -> tuple[int, ...]: ...

    def explain(
        self, entry: Tenant, reason: int, retry: int, prompt: int, max_tokens: int
    ) -> tuple[int, int]: ...

    def tenant_wide(self, entry: Tenant, hour: int, day: int) -> tuple[int, int]: ...

    def take_reservation_ids(self, count: int) -> int: ...

    def columns(
        self, rows: npt.NDArray[np.int64], is_fresh: npt.NDArray[np.bool_],
        degraded: npt.NDArray[np.bool_] | None, verdicts: dict[tuple[str, str], Verdict],
        multiplier: float, *, plain: bool = False,
    ) -> BatchResult: ...  # fmt: skip
