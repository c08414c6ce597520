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

from controlplane.domain.errors import PermissionDenied
from controlplane.domain.scope import KeyScope, quote
from controlplane.service.tenants import Tenant


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
