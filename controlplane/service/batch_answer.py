"""The last step of a batch decided in columns (batch.py): the gate told of
the admissions, the rows stored and counted (demand included), and the
answer's columns signed. Kept apart from the decision's steps: nothing
here decides anything."""

from __future__ import annotations

import numpy as np

from controlplane.service import records as R
from controlplane.service.answers import BatchResult
from controlplane.service.batch import _CAPACITY, _OK, _P_FAIL_OPEN, _P_POOL, BatchDecision
from controlplane.service.stats import AdmissionStats


def count_demand(b: BatchDecision, stats: AdmissionStats) -> None:
    """The fresh entries that are demand on their pool (admitted or
    refused for capacity; a recognised retry was counted at its first
    attempt: service/demand.py), added per pool in one go."""
    reason = b.rows[:, R.REASON]
    asked = b.is_fresh & ((reason == _OK) | _CAPACITY[reason])
    if b.retries is not None:
        again = [*b.retries.late, *b.retries.first]
        asked[again] = False
    if not asked.any():
        return
    prompts = b.prompt[asked]
    if len(b.pools) == 1:  # the common batch: every entry on one pool
        stats.demand.add(b.pools[0], b.now, int(prompts.sum()), len(prompts))
        return
    pool_ix = b.pv[asked, _P_POOL]
    for k in dict.fromkeys(pool_ix.tolist()):
        mine = pool_ix == k
        stats.demand.add(b.pools[k], b.now, int(prompts[mine].sum()), int(mine.sum()))


def store(b: BatchDecision, stats: AdmissionStats) -> BatchResult:
    """The gate told of the admissions, the rows stored and counted;
    the answer's columns."""
    d, rows, admitted = b.d, b.rows, b.admitted
    if d.gate.enabled and admitted.any():
        pv, pools = b.pv, b.pools
        adm = np.flatnonzero(admitted)
        pool_ix = pv[:, _P_POOL]
        ks = [0] if len(pools) == 1 else dict.fromkeys(pool_ix[adm].tolist())
        for k in ks:
            if k in b.released_pools:
                continue  # released in order before its refusals (conclude)
            mine = adm if len(pools) == 1 else adm[pool_ix[adm] == k]
            first = pv[mine, _P_FAIL_OPEN].astype(bool).tolist()
            d.gate.released_many(pools[k], b.now, b.prompt[mine].tolist(), first)
    log = b.log
    log.add_rows(b.tkeys, b.tenant_ids, b.request_ids, rows, b.fresh)
    stats.count_rows(
        rows[b.is_fresh] if b.replayed else rows, log.names.names,
        len(b.tenants.by_slot), b.any_shadow,
    )  # fmt: skip
    count_demand(b, stats)
    # Degradation instructions go with an admission (as a unary answer's):
    # a refusal says the pool's state in its pressure, not in instructions.
    # (none when no verdict caps and no replay brings a cap of its own)
    plain = b.all_admitted
    degraded = None if plain and not b.any_capped else rows[:, R.DEGRADED_CAP] > 0
    # Entries of one batch may resolve to different pools: the batch-level
    # multiplier is the first fresh entry's (each admission's record, which
    # the ledger bills, locks its own pool's).
    first = b.prices.get(b.batch_pools[0]) if b.batch_pools else None
    result = d.columns(
        rows, b.is_fresh, degraded, b.verdicts,
        first.multiplier if first is not None else 1.0, plain=plain,
    )  # fmt: skip
    # each admission's token, replays included (Outcomes.answer's rule)
    result.admission_token = d.signer.sign_rows(
        rows, b.tenant_ids, b.request_ids, log.names.names
    )
    return result
