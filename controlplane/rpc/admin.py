"""burstgate.v1.AdminService: protobuf <-> admin store and live service state.

Writes run in a thread (SQLAlchemy), each in one transaction with its audit
record; then the plane reloads its config on the event loop before the call
returns, so the change is live on the fast path when the operator sees OK.
Reads of live state run on the loop, where the fast path lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc
import structlog
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admin_pb2_grpc as apb_grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from google.protobuf.timestamp_pb2 import Timestamp

from controlplane.auth import KeyCache
from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.errors import FailedPrecondition, InvalidArgument, excerpt
from controlplane.domain.keys import parse_role
from controlplane.domain.money import format_multiplier
from controlplane.rpc.admin_pb import (
    LANE_MASK_FIELDS,
    audit_to_pb,
    decode_page_token,
    encode_page_token,
    json_value,
    key_to_pb,
    lane_to_pb,
    mask_paths,
    optional_pool,
    page_size,
    parse_decimal,
    parse_timestamp,
    policy_to_pb,
    tenant_changes,
    tenant_from_pb,
    tenant_to_pb,
)
from controlplane.rpc.auth import current_actor
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.errors import unary_errors
from controlplane.service import AdmissionService
from controlplane.settings import Settings
from controlplane.store.audit import AuditLog
from controlplane.store.config import ConfigRepository
from controlplane.store.keys import KeyStore
from controlplane.telemetry.live import pools_demand, pools_live, tenant_live

log = structlog.get_logger("burstgate.admin")


class Plane(Protocol):
    """What the servicer needs from the running ControlPlane."""

    settings: Settings
    service: AdmissionService

    @property
    def config_reloads(self) -> int: ...

    async def load_config(self) -> bool: ...

    async def ready_tenants(self, tenant_ids: Sequence[str]) -> None: ...


class AdminServicer(apb_grpc.AdminServiceServicer):
    def __init__(
        self,
        plane: Plane,
        store: ConfigRepository,
        key_store: KeyStore,
        key_cache: KeyCache,
        audit: AuditLog,
        db: DbCaller,
    ) -> None:
        self._db = db  # every database call below: bounded, UNAVAILABLE past it
        self._plane = plane
        self._svc = plane.service
        self._store = store
        self._keys = key_store
        self._key_cache = key_cache
        self._audit = audit

    @staticmethod
    def _actor() -> Actor:
        return current_actor()

    async def _apply(self, tenant_id: str = "") -> None:
        """Make a committed change live before answering (the reload's
        database reads are bounded like the poll's); ``tenant_id``: a tenant
        created, changed or enabled, usable on every door of this replica
        once the call returns (its share of its limits held here, which an
        AdmitStream batch does not wait for)."""
        try:
            await self._plane.load_config()
            if tenant_id:
                await self._plane.ready_tenants((tenant_id,))
        except Exception as exc:  # stored; the config poll applies it
            log.warning("change stored but reload failed; the poll will retry", error=str(exc))

    # ---------------------------------------------------------- tenants

    @unary_errors
    async def CreateTenant(
        self, request: apb.CreateTenantRequest, context: grpc.aio.ServicerContext
    ) -> apb.Tenant:
        cfg = tenant_from_pb(request.tenant)
        rec = await self._db.run(self._store.add_tenant, cfg, self._actor())
        await self._apply(cfg.tenant_id)
        return tenant_to_pb(rec)

    @unary_errors
    async def GetTenant(
        self, request: apb.GetTenantRequest, context: grpc.aio.ServicerContext
    ) -> apb.Tenant:
        return tenant_to_pb(await self._db.run(self._store.get_tenant, request.tenant_id))

    @unary_errors
    async def ListTenants(
        self, request: apb.ListTenantsRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListTenantsResponse:
        limit = page_size(request.page_size)
        after = decode_page_token(request.page_token) if request.page_token else ""
        page, last = await self._db.run(self._store.list_tenants, limit, after)
        return apb.ListTenantsResponse(
            tenants=[tenant_to_pb(r) for r in page],
            next_page_token=encode_page_token(last) if last else "",
        )

    @unary_errors
    async def UpdateTenant(
        self, request: apb.UpdateTenantRequest, context: grpc.aio.ServicerContext
    ) -> apb.Tenant:
        changes = tenant_changes(request.tenant, list(request.update_mask.paths))
        rec = await self._db.run(
            self._store.update_tenant, request.tenant.tenant_id, changes, self._actor()
        )
        await self._apply(request.tenant.tenant_id)
        return tenant_to_pb(rec)

    async def _set_enabled(self, tenant_id: str, enabled: bool) -> apb.Tenant:
        rec = await self._db.run(self._store.set_enabled, tenant_id, enabled, self._actor())
        await self._apply(tenant_id if enabled else "")
        return tenant_to_pb(rec)

    @unary_errors
    async def DisableTenant(
        self, request: apb.DisableTenantRequest, context: grpc.aio.ServicerContext
    ) -> apb.Tenant:
        return await self._set_enabled(request.tenant_id, False)

    @unary_errors
    async def EnableTenant(
        self, request: apb.EnableTenantRequest, context: grpc.aio.ServicerContext
    ) -> apb.Tenant:
        return await self._set_enabled(request.tenant_id, True)

    @unary_errors
    async def DeleteTenant(
        self, request: apb.DeleteTenantRequest, context: grpc.aio.ServicerContext
    ) -> apb.DeleteTenantResponse:
        tenant_id = request.tenant_id
        # Counted on the loop (the fast path's thread). An Admit that lands
        # between this count and the commit is still settleable after the
        # delete: deleted tenants keep their open reservations.
        open_now = (
            self._svc.views.tenant_state(tenant_id)["inflight"]
            if tenant_id in self._svc.views.tenant_ids()
            else 0
        )

        def guard(cfg: TenantConfig) -> None:
            if request.force:
                return
            if open_now:
                raise FailedPrecondition(
                    f"tenant_id: tenant {excerpt(tenant_id)} has {open_now} unsettled "
                    "reservation(s); wait for them to settle or expire, or delete with force"
                )

        rec = await self._db.run(self._store.delete_tenant, tenant_id, self._actor(), guard)
        await self._apply()
        return apb.DeleteTenantResponse(tenant=tenant_to_pb(rec), open_reservations=open_now)

    # ------------------------------------------------------------ lanes

    @unary_errors
    async def ListLanes(
        self, request: apb.ListLanesRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListLanesResponse:
        lanes = await self._db.run(self._store.lanes)
        return apb.ListLanesResponse(lanes=[lane_to_pb(lane) for lane in lanes])

    @unary_errors
    async def UpdateLane(
        self, request: apb.UpdateLaneRequest, context: grpc.aio.ServicerContext
    ) -> apb.Lane:
        lane = request.lane
        paths = mask_paths(list(request.update_mask.paths), LANE_MASK_FIELDS, "Lane")
        changes: dict[str, Any] = {}
        for p in paths:
            if p == "weight":
                changes[p] = parse_decimal("weight", lane.weight)
            elif p == "max_queued":
                changes[p] = lane.max_queued if lane.HasField("max_queued") else None
            elif p == "pool":
                changes[p] = optional_pool(lane)
            else:
                changes[p] = getattr(lane, p)
        updated = await self._db.run(
            self._store.update_lane,
            lane.name,
            changes,
            self._actor(),
            allow_missing=request.allow_missing,
        )
        await self._apply()
        return lane_to_pb(updated)

    # ----------------------------------------------------------- policy

    @unary_errors
    async def GetPolicy(
        self, request: apb.GetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> apb.Policy:
        overrides = await self._db.run(self._store.policy_overrides)
        return policy_to_pb(self._plane.settings.policy, overrides)

    @unary_errors
    async def UpdatePolicy(
        self, request: apb.UpdatePolicyRequest, context: grpc.aio.ServicerContext
    ) -> apb.Policy:
        if not request.set and not request.reset:
            raise InvalidArgument("set", "nothing to change: give set and/or reset")
        values = {k: json_value(k, v) for k, v in request.set.items()}
        base = self._plane.settings.policy
        _, stored = await self._db.run(
            self._store.update_policy, base, values, list(request.reset), self._actor()
        )
        await self._apply()
        return policy_to_pb(base, stored)

    # ------------------------------------------------------- live state

    @unary_errors
    async def GetTenantState(
        self, request: apb.GetTenantStateRequest, context: grpc.aio.ServicerContext
    ) -> apb.TenantState:
        rec = await self._db.run(self._store.get_tenant, request.tenant_id)
        live = tenant_live(self._svc, request.tenant_id)  # on the loop
        as_of = Timestamp()
        as_of.FromNanoseconds(self._svc.clock())
        return apb.TenantState(
            tenant_id=live.tenant_id,
            enabled=rec.config.enabled,
            bucket_tokens=live.bucket_tokens,
            burst_tokens=live.burst_tokens,
            hourly_used_tokens=live.hourly_used,
            daily_used_tokens=live.daily_used,
            hourly_quota=live.hourly_quota,
            daily_quota=live.daily_quota,
            in_flight_requests=live.in_flight,
            in_flight_tokens=live.in_flight_tokens,
            queued_requests=live.queued,
            as_of=as_of,
        )

    @unary_errors
    async def GetServerState(
        self, request: apb.GetServerStateRequest, context: grpc.aio.ServicerContext
    ) -> apb.ServerState:
        svc = self._svc
        as_of = Timestamp()
        as_of.FromNanoseconds(svc.clock())
        return apb.ServerState(
            fastpath=svc.implementation,
            tenants=len(svc.views.tenant_ids()),
            open_reservations=svc.views.open_reservations,
            config_reloads=self._plane.config_reloads,
            decisions=[
                apb.DecisionCount(
                    decision=pb.Decision.ValueType(d), reason=pb.Reason.ValueType(r), count=n
                )
                for (d, r), n in sorted(svc.stats.decision_counts.items())
            ],
            pools=pool_states(svc),
            as_of=as_of,
        )

    # ------------------------------------------------------------ audit

    @unary_errors
    async def ListAuditEvents(
        self, request: apb.ListAuditEventsRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListAuditEventsResponse:
        limit = page_size(request.page_size)
        before = 0
        if request.page_token:
            token = decode_page_token(request.page_token)
            if not token.isdigit():
                raise InvalidArgument("page_token", "not a token returned by this API")
            before = int(token)
        events, next_before = await self._db.run(
            lambda: self._audit.list(
                limit, before, target=request.target, actor=request.actor, action=request.action
            )
        )
        return apb.ListAuditEventsResponse(
            events=[audit_to_pb(e) for e in events],
            next_page_token=encode_page_token(str(next_before)) if next_before else "",
        )

    # ------------------------------------------------------------- keys

    @unary_errors
    async def CreateApiKey(
        self, request: apb.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> apb.CreateApiKeyResponse:
        role = parse_role(request.role)
        expires_at = (
            parse_timestamp("expire_time", request.expire_time)
            if request.HasField("expire_time")
            else None
        )
        actor = self._actor()
        secret, info = await self._db.run(
            lambda: self._keys.create_key(
                request.name, role, actor, tenants=list(request.tenants),
                pools=list(request.pools), expires_at=expires_at,
            )
        )  # fmt: skip
        await self._db.run(self._key_cache.refresh)
        return apb.CreateApiKeyResponse(key=key_to_pb(info), secret=secret)

    @unary_errors
    async def ListApiKeys(
        self, request: apb.ListApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListApiKeysResponse:
        keys = await self._db.run(lambda: self._keys.list(include_revoked=request.include_revoked))
        return apb.ListApiKeysResponse(keys=[key_to_pb(k) for k in keys])

    @unary_errors
    async def RevokeApiKey(
        self, request: apb.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> apb.ApiKey:
        info = await self._db.run(self._keys.revoke_key, request.key_id, self._actor())
        await self._db.run(self._key_cache.refresh)
        return key_to_pb(info)


def pool_states(svc: AdmissionService) -> list[apb.PoolState]:
    """Every pool that reported or that the service knows of (declared,
    asked, holding work): its engines and backpressure, and what it is asked
    and needs (docs/autoscaling.md, "Signals"). Loop thread only."""
    live = {p.pool: p for p in pools_live(svc)}
    demand = {d.pool: d for d in pools_demand(svc)}
    now = svc.clock()
    out = []
    for pool in sorted(set(live) | set(demand)):
        p = live.get(pool)
        d = demand.get(pool) or svc.views.pool_demand(pool, now)
        multiplier = p.pricing_multiplier if p else svc.pricing.quote(pool, "", now).multiplier
        out.append(apb.PoolState(
            pool=pool,
            engines_reporting=p.engines if p else d.engines_reporting,
            backpressure_score=p.backpressure if p else 0.0,
            pricing_multiplier=format_multiplier(multiplier),
            demand_tokens_per_second=d.demand_tokens_per_s,
            demand_requests_per_second=d.demand_requests_per_s,
            desired_engines=d.desired_engines,
            desired_engines_predicted=d.desired_engines_predicted,
            work_rate_tokens_per_second_per_engine=d.work_rate_per_engine,
            kv_cache_miss_rate=p.kv_cache_miss_rate if p else None,
            evict_below_reuse_per_s=(
                p.evict_below_reuse_per_s if p else svc.views.eviction_advice(pool)[1]
            ),
            lanes=[
                apb.PoolLaneBacklog(
                    lane=b.lane, requests=b.requests, tokens=b.tokens,
                    predicted_wait_seconds=b.predicted_wait_s,
                )
                for b in d.lanes
            ],
        ))  # fmt: skip
    return out
