"""Read-only views of the admission service, for metrics, status and the
admin and Envoy doors: ``service.views``.

Nothing here changes state; every answer is computed from the parts the
service owns, at the service clock's now. Kept apart from the façade so
the deciding API (admit, tick, complete, report_load) reads on its own and
the many questions operators ask do not grow it."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.domain import LaneConfig, LoadSample
from controlplane.domain.autoscaler import engines_for
from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.domain.validate import check_id
from controlplane.service.deadlines import Deadlines
from controlplane.service.demand import DESIRED_WINDOW_S, LaneBacklog, PoolDemand
from controlplane.service.gate import PoolGate
from controlplane.service.limits import TenantLimits
from controlplane.service.limits import describe as describe_limits
from controlplane.service.pools import pool_miss_rate
from controlplane.service.pressure import PressureGate, eviction_advice
from controlplane.service.queueing import WaitQueues
from controlplane.service.records import RequestLog
from controlplane.service.recordview import RecordView
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import TenantDirectory, early_reason
from fastpath import Reason, TokenBucketTable


class ServiceViews:
    """What the service can tell without deciding anything."""

    def __init__(
        self, *, clock: Callable[[], int], table: TokenBucketTable, tenants: TenantDirectory,
        log: RequestLog, queues: WaitQueues, deadlines: Deadlines, pressure: PressureGate,
        gate: PoolGate, stats: AdmissionStats, target_utilization: float,
        engine_startup_s: float,
    ) -> None:  # fmt: skip
        self._clock = clock
        self._table = table
        self._tenants = tenants
        self._log = log
        self._queues = queues
        self._deadlines = deadlines
        self._pressure = pressure
        self._gate = gate
        self._stats = stats
        self._util = target_utilization
        self._startup_s = engine_startup_s

    # ----------------------------------------------------------------- tenants

    @property
    def lanes(self) -> dict[str, LaneConfig]:
        return dict(self._tenants.lanes)

    def tenant_ids(self) -> list[str]:
        return self._tenants.ids()

    def tenant_ids_by_slot(self) -> list[str]:
        """Every tenant id ever configured, by fast-path slot (the keys of
        ``stats``; deleted tenants included: a slot is never reused)."""
        return [entry.config.tenant_id for entry in list(self._tenants.by_slot)]

    def tenant_state(self, tenant_id: str) -> dict[str, int]:
        """The tenant's bucket, quotas and in-flight counts, refilled to now
        (under shares: its whole limits and tenant-wide quota use,
        ``TenantDirectory.reported_state``)."""
        return self._tenants.reported_state(tenant_id, self._clock())

    def tenant_limits(self, tenant_id: str) -> TenantLimits:
        """The tenant's limits and their state now (GetLimits); NotFound
        for a tenant that is not configured."""
        check_id("tenant_id", tenant_id)
        now = self._clock()
        return describe_limits(tenant_id, self._tenants.reported_state(tenant_id, now), now)

    def check_only(self, tenant_id: str) -> tuple[int, int, TenantLimits | None]:
        """A check that spends nothing (Envoy's ``hits_addend`` 0): the
        refusal the tenant alone would give a request now - unknown or
        disabled, an empty bucket, a used-up quota - as (reason,
        retry_after_ns, the limits of the tenant charged: the default tenant
        for an unknown id when configured); nothing changes. Concurrency and
        the pools' backpressure are for requests that reserve."""
        check_id("tenant_id", tenant_id)
        entry = self._tenants.resolve(tenant_id)
        early = early_reason(entry)
        if entry is None:
            return early, 0, None
        now = self._clock()
        charged = entry.config.tenant_id
        t = describe_limits(charged, self._tenants.reported_state(charged, now), now)
        if early:
            return early, 0, t
        if t.bucket_tokens <= 0:  # refills to one token after:
            need_ns = -(-(1 - t.bucket_tokens) * NS_PER_S * 1000 // int(t.token_rate * 1000))
            return int(Reason.TOKEN_RATE), need_ns, t
        if t.hourly_remaining == 0:
            return int(Reason.HOURLY_QUOTA), t.hour_resets_in_ms * NS_PER_MS, t
        if t.daily_remaining == 0:
            return int(Reason.DAILY_QUOTA), t.day_resets_in_ms * NS_PER_MS, t
        return 0, 0, t

    def fallback_model(self, tenant_id: str) -> str:
        """The model a degraded request of ``tenant_id`` is routed to ("" = none)."""
        return self._tenants.fallback_model(tenant_id)

    def tenant_queued(self, tenant_id: str) -> int:
        """Admit calls of ``tenant_id`` waiting in any lane's queue."""
        entry = self._tenants.get(tenant_id)
        return 0 if entry is None else self._queues.per_tenant.get(entry.slot, 0)

    # ---------------------------------------------------------------- requests

    def inflight_tokens(self) -> int:
        """All tenants' reserved, unsettled tokens (the global watermark's measure)."""
        return int(self._table.total_inflight_tokens())

    def record(self, tenant_id: str, request_id: str) -> RecordView | None:
        """What the plane remembers of a request, if anything."""
        rec = self._log.get((tenant_id, request_id))
        return None if rec is None else RecordView.of(rec)

    @property
    def open_reservations(self) -> int:
        return self._log.open_count

    @property
    def remembered_requests(self) -> int:
        return len(self._log)

    def queue_depths(self) -> dict[str, int]:
        return self._queues.lane_depths()

    def queue_footprint(self) -> dict[str, int]:
        """Sizes of the queues' internal indexes (benchmarks check for leaks)."""
        return self._queues.footprint()

    # ------------------------------------------------------------------- pools

    def declared_pools(self) -> frozenset[str]:
        """The pools the config declares (``tenants.declared_pools``): the
        only names a request may give."""
        return self._tenants.declared

    def gate_inflight(self, pool: str) -> int:
        """Requests the pool gate counts in flight in ``pool`` (released or
        restored here, not yet completed)."""
        return self._gate.inflight(pool)

    def ttft_samples(self, pool: str) -> int:
        """First tokens Completes reported for ``pool`` (docs/gate.md: they
        teach the gate the pool's time to first token)."""
        return self._gate.ttft_samples(pool)

    def pool_holds(self) -> dict[str, int]:
        """Pools whose gate is held after a takeover now -> when the hold
        ends (service clock, ns)."""
        now = self._clock()
        return {p: until for p, until in self._gate.holds().items() if until > now}

    def eviction_advice(self, pool: str) -> tuple[float, float]:
        """(the pool's load, the KV-cache reuse rate per second under which its
        engines should evict), answered with each load report."""
        load = self._pressure.score(pool, self._clock())
        return load, eviction_advice(load)

    def pool_miss_rate(self, pool: str) -> float | None:
        """The prefix-cache miss rate ``pool``'s fresh load reports give (as
        the backpressure score weighs it); None when none measures it."""
        book = self._pressure.book
        p = book.pools.get(pool)
        return None if p is None else pool_miss_rate(p.fresh(self._clock(), book.stale_ns))

    def pool_views(self) -> dict[str, tuple[float, int, bool]]:
        """pool -> (backpressure score, freshness, degraded), for operators."""
        return self._pressure.views(self._clock())

    @property
    def pools(self) -> dict[str, dict[str, LoadSample]]:
        """pool -> engine id -> latest load report."""
        return self._pressure.reports()

    def demand_pools(self) -> list[str]:
        """The pools :meth:`pool_demand` has something to say about: the
        declared ones, and any that reported, was asked or holds work."""
        names = set(self._tenants.declared) | set(self._pressure.book.pools)
        names |= set(self._stats.demand.meters) | set(self._queues.pool_waiting)
        return sorted(names)

    def pool_demand(self, pool: str, now: int | None = None) -> PoolDemand:
        """What ``pool`` is asked and what it needs now (``now``: the service
        clock's, default its current time), for an autoscaler
        (docs/autoscaling.md, "Signals"; service/demand.py):

        - demand: prompt tokens and requests per second asked of the pool
          over the last ``DEMAND_WINDOW_S`` (admitted, held, or refused for
          capacity; not refusals for a tenant's own limits);
        - per lane, the requests and prompt tokens held for the pool in
          burstgate's queues, and the predicted wait of a new request: the
          held work ahead of it (``Deadlines.ahead_tokens``: premium first,
          the fair order's share of the others) at the pool's pace;
        - ``desired_engines``: with a learned work rate ``r`` per engine
          (prompt tokens one engine took per second in the seconds the gate
          held work for the pool, ``demand.WorkRate``; before any, the
          gate's pace over the engines reporting) and the target
          utilisation ``U`` (``autoscale_target_utilization``), the larger of
          ceil(demand / (r U)) and, for each lane with work held, ceil(work
          ahead of a new request / (T r U)), T its TTFT SLO less the
          engine's share of it (``Deadlines.engine_ns``), else its wait
          target: enough to take the demand, and to release what is held
          in time for each lane's SLO. Before any rate is learned: the engines
          reporting now (at least one while anything is asked or held): the
          plane cannot tell how many fewer would do;
        - ``desired_engines_predicted``: ceil(forecast demand at now +
          ``autoscale_engine_startup_s`` / (r U)), the forecast from the
          burst forecaster's model fed each second's demand; equal to
          ``desired_engines`` before a rate is learned.

        Any pool name may be asked (an unknown one is all zeros). Reads
        only; O(engines + lanes)."""
        now = self._clock() if now is None else now
        util = self._util
        book = self._pressure.book.pools.get(pool)
        engines = len(book.fresh(now, self._pressure.book.stale_ns)) if book else 0
        # per engine: the work rate in gated seconds (demand.WorkRate); until
        # the pool has had one, the pace over the engines reporting now
        per_engine = self._gate.work_rate(pool, now)
        if per_engine is None:
            rate = self._gate.pace_rate(pool)
            per_engine = rate / engines if rate and engines else None
        meter = self._stats.demand.meters.get(pool)
        tokens_s, requests_s = meter.rates(now) if meter is not None else (0.0, 0.0)
        # the demand term's average is longer (demand.DESIRED_WINDOW_S)
        steady_s = meter.rates(now, DESIRED_WINDOW_S)[0] if meter is not None else 0.0
        forecast = meter.forecast(now, self._startup_s) if meter is not None else 0.0
        queues = self._queues
        held = queues.pool_waiting.get(pool)
        held_tokens = queues.pool_tokens.get(pool)
        deadlines = self._deadlines
        backlog: list[LaneBacklog] = []
        drain = 0  # engines to release each lane's held work within its SLO
        for lane_cfg in self._tenants.by_priority:
            idx = queues.lane_index(lane_cfg.name)
            n = held[idx] if held is not None and idx < len(held) else 0
            tokens = held_tokens[idx] if held_tokens is not None and idx < len(held_tokens) else 0
            ahead = deadlines.ahead_tokens(pool, idx) if held is not None else 0
            wait_ns = self._gate.wait_ns(pool, ahead) if ahead else 0
            backlog.append(LaneBacklog(
                lane_cfg.name, n, tokens, None if wait_ns is None else wait_ns / NS_PER_S
            ))  # fmt: skip
            # released in time: by its SLO less the engine's share of it
            # (Deadlines.engine_ns, for the held requests' mean prompt);
            # without an SLO, by the lane's wait target
            slo = deadlines.slo_ns(lane_cfg.name)
            if slo:
                bound_ns = slo - deadlines.engine_ns(slo, pool, tokens // max(1, n))
            else:
                bound_ns = lane_cfg.wait_target_ms * NS_PER_MS
            if ahead and per_engine is not None and bound_ns > 0:
                drain = max(drain, engines_for(ahead * NS_PER_S / bound_ns, per_engine, util))
        if per_engine is None:
            asked = steady_s > 0 or any(b.requests for b in backlog)
            desired = predicted = max(engines, 1 if asked else 0)
        else:
            desired = max(engines_for(steady_s, per_engine, util), drain)
            predicted = engines_for(forecast, per_engine, util)
        return PoolDemand(
            pool, engines, tokens_s, requests_s, per_engine, desired, predicted, forecast,
            tuple(backlog),
        )  # fmt: skip
