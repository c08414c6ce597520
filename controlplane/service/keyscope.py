"""A scoped sidecar key against what a request would actually use.

The gRPC adapter checks the tenant ids a request names; here, after the
service has resolved them, the tenant a request is charged to and the pool
it is sent to. A request that names no pool goes to its tenant's, else its
(final, after length-aware placement) lane's, else the default pool: a key
for pool-a must not reach pool-b by leaving ``pool`` empty or by picking a
lane. An unknown tenant id charged to the default tenant
(``BURSTGATE_DEFAULT_TENANT``) needs the default tenant in the key's scope
too, or a key for ``team-*`` could spend it with made-up ids.
"""

from __future__ import annotations

import numpy as np

from controlplane.domain.errors import PermissionDenied
from controlplane.domain.scope import KeyScope, quote
from controlplane.service.batch import BatchDecision
from controlplane.service.tenants import Tenant
from fastpath import Reason


def check_scope(
    scope: KeyScope, tenant_id: str, entry: Tenant, pool: str, whose: str, field: str = "tenant_id"
) -> None:
    """``entry``: the tenant ``tenant_id`` resolved to; ``whose`` names the
    request in the message ("this request's", "entry 3's")."""
    charged = entry.config.tenant_id
    if charged != tenant_id and charged not in scope.tenants:
        raise PermissionDenied(
            f"unknown tenant {quote(tenant_id)} would be charged to the default tenant "
            f"{quote(charged)}, which is outside this key's tenants",
            field=field,
        )
    scope.check_pool("pool", pool, f"{whose} pool")


def check_batch_scope(b: BatchDecision, scope: KeyScope) -> None:
    """A scoped key's batch (batch.py, after its ``place`` step): the pools
    its entries go to and the tenants they are charged to, per pair and per
    tenant (a handful); entries are walked only when one of those is outside
    the scope, to name the first entry that would be decided with it.
    Before anything changes."""
    bad_pairs = {k for k, (_, p) in enumerate(b.pair_keys) if p and p not in scope.pools}
    bad_tenants = {
        j for j, (t, e) in enumerate(zip(b.order, b.t_entry, strict=True))
        if e is not None and e.config.tenant_id != t and e.config.tenant_id not in scope.tenants
    }  # fmt: skip
    if not bad_pairs and not bad_tenants:
        return
    decided = b.is_fresh & (b.early == int(Reason.OK))
    for i in np.flatnonzero(decided).tolist():
        j, k = b.tix[i], int(b.pair[i])
        entry = b.t_entry[j]
        if (j in bad_tenants or k in bad_pairs) and entry is not None:
            check_scope(scope, b.tenant_ids[i], entry, b.pair_keys[k][1],
                        f"entry {i}'s", f"tenant_id[{i}]")  # fmt: skip
