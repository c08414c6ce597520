"""Admission policies compared by ``burstgate simulate``.

- ``fifo``: no admission control; every request goes straight to the pool.
- ``drop-late``: no admission control either, but a request whose TTFT
  deadline passes before its engine starts it is aborted at the engine (a
  gateway timeout or a client that hangs up does that to vLLM): no engine
  time goes to a request that has already missed. The cheapest baseline an
  admission plane has to beat.
- ``rate-limit``: a per-tenant request-rate limit (a token bucket over
  requests, the usual API-gateway limit): refused when the bucket is empty.
- ``burstgate``: burstgate's real service layer
  (``controlplane.service.AdmissionService``) on the simulated clock, with
  the default lanes and policy (or a config file's lanes, tenants and
  policy), fed the engines' load reports. Requests it queues wait in its
  own queues and are released when it says so. It is told only what a
  sidecar in front of vLLM can tell it: tenant, a request id per attempt,
  the tenant's default lane, prompt tokens, max_tokens and the pool; never
  the client's SLO or first-arrival deadline.

Tenant limits for ``rate-limit`` and the default ``burstgate`` config are
derived from the trace the same way (the issue's measurement setup): each
tenant's rate is ``rate_factor`` (1.5) x its mean rate in the scaled trace
(requests/s, or tokens/s for burstgate's token buckets) and its burst is
``burst_s`` (2) seconds of that rate.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from controlplane.domain import (
    DEFAULT_LANES,
    AdmitDecision,
    Decision,
    LaneConfig,
    TenantConfig,
)
from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_S
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.service.demand import PoolDemand
from controlplane.settings import Settings
from controlplane.sim.engine import Engine
from controlplane.sim.harness import POOL as POOL  # re-exported: the tests name it
from controlplane.sim.harness import Job, Simulation
from controlplane.sim.pool import Pool
from controlplane.sim.trace import TraceRequest
from fastpath import Reason


@dataclass(frozen=True, slots=True)
class TenantRates:
    """A tenant's mean rates over the scaled trace."""

    requests_per_s: float
    tokens_per_s: float


def tenant_rates(trace: list[TraceRequest]) -> dict[str, TenantRates]:
    span_s = max(1e-9, (trace[-1].t_ns - trace[0].t_ns) / NS_PER_S) if trace else 1.0
    counts: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for r in trace:
        counts[r.tenant] = counts.get(r.tenant, 0) + 1
        tokens[r.tenant] = tokens.get(r.tenant, 0) + r.prompt_tokens + r.output_tokens
    return {t: TenantRates(counts[t] / span_s, tokens[t] / span_s) for t in counts}


class Fifo:
    """No admission control."""

    name = "fifo"

    def start(self, sim: Simulation, pool: Pool) -> None:
        self.sim = sim

    def arrive(self, job: Job) -> None:
        self.sim.release(job)

    def completed(self, job: Job) -> None:
        return None

    def report(self, engine: Engine) -> None:
        return None

    def next_wakeup_ns(self) -> int | None:
        return None

    def tick(self) -> None:
        return None


class DropLate(Fifo):
    """FIFO into the engines; a released request still waiting in its
    engine's queue when its TTFT deadline passes is aborted there."""

    name = "drop-late"

    def start(self, sim: Simulation, pool: Pool) -> None:
        self.sim = sim
        self._due: list[tuple[int, int, Job]] = []  # (deadline, order, job)
        self._order = itertools.count()

    def arrive(self, job: Job) -> None:
        self.sim.release(job)
        heapq.heappush(self._due, (job.deadline_ns, next(self._order), job))

    def next_wakeup_ns(self) -> int | None:
        due = self._due
        while due and due[0][2].req.started_ns >= 0:  # started in time: nothing to drop
            heapq.heappop(due)
        return due[0][0] if due else None

    def tick(self) -> None:
        now = self.sim.now
        due = self._due
        while due and due[0][0] <= now:
            _, _, job = heapq.heappop(due)
            self.sim.abort_unstarted(job, "DEADLINE")  # False once it has started


class RequestRateLimit(Fifo):
    """A token bucket over requests per tenant; an empty bucket refuses with
    the exact time until the next token."""

    name = "rate-limit"

    def __init__(self, rates: dict[str, TenantRates], factor: float, burst_s: float) -> None:
        self._rate = {t: r.requests_per_s * factor for t, r in rates.items()}
        self._cap = {t: max(1.0, rate * burst_s) for t, rate in self._rate.items()}
        self._level = dict(self._cap)
        self._at: dict[str, int] = dict.fromkeys(self._rate, 0)

    def arrive(self, job: Job) -> None:
        now = self.sim.now
        t = job.tenant
        rate = self._rate[t]
        level = min(self._cap[t], self._level[t] + rate * (now - self._at[t]) / NS_PER_S)
        self._at[t] = now
        if level >= 1.0:
            self._level[t] = level - 1.0
            self.sim.release(job)
        else:
            self._level[t] = level
            self.sim.refuse(job, "RATE_LIMIT", int((1.0 - level) / rate * NS_PER_S), True)


class Burstgate:
    """burstgate's AdmissionService, driven through its public in-process
    API on the simulated clock."""

    def __init__(
        self,
        tenants: list[TenantConfig],
        lanes: tuple[LaneConfig, ...] | list[LaneConfig] = DEFAULT_LANES,
        policy: Policy | None = None,
        *,
        name: str = "burstgate",
        max_tokens_factor: float = 1.0,
        retry_keys: bool = True,
        first_tokens: bool = True,
    ) -> None:
        self.name = name
        self._tenants = tenants
        self._lanes = list(lanes)
        self._policy = policy
        self._max_tokens_factor = max_tokens_factor
        self._retry_keys = retry_keys  # pass Job.retry_key with each attempt
        self._first_tokens = first_tokens  # report first-token times with Completes
        # The plane's BURSTGATE_AUTOSCALE_ENGINE_STARTUP_S: how far ahead
        # desired_engines_predicted looks (simulate --engine-startup-s).
        self.engine_startup_s: float | None = None

    def start(self, sim: Simulation, pool: Pool) -> None:
        self.sim = sim
        self.pool = pool
        # A reservation TTL longer than any run: a simulated hour of slow
        # requests must not see reservations expire under them.
        settings = Settings(reservation_ttl_s=86_400, database_url="sqlite://")
        if self.engine_startup_s is not None:
            settings = settings.model_copy(
                update={"autoscale_engine_startup_s": self.engine_startup_s}
            )
        self.svc = AdmissionService(ServiceLimits.of(settings), clock=lambda: sim.now)
        # The simulated operator declares the one pool its engines serve
        # (an undeclared pool is refused, docs/operating.md).
        policy = self._policy if self._policy is not None else settings.policy
        policy = policy.model_copy(update={"known_pools": sorted({*policy.known_pools, POOL})})
        self.svc.apply_config(self._tenants, self._lanes, policy)
        self._rid: dict[str, str] = {}

    def _answer(self, job: Job, d: AdmitDecision) -> None:
        if d.decision == Decision.ADMIT:
            self.sim.release(job)
            return
        self.sim.refuse(job, Reason(d.reason).name, d.retry_after_ns, d.retryable)

    def arrive(self, job: Job) -> None:
        req = job.req
        # A new request id per attempt, as the HTTP sidecar mints one per
        # HTTP request, and the retry key the sidecar derives from the
        # request (the same on every attempt; service/retries.py).
        rid = job.attempt_id
        self._rid[str(req.key)] = rid
        max_tokens = max(1, int(req.output * self._max_tokens_factor))
        # What a sidecar sends: lane "" (the tenant's default), model "",
        # and no deadline of the client's: the sidecar's own gRPC deadline is
        # its lane's max wait (0.75 x the lane's SLO by default), the same
        # bound the server applies by itself, counted from this attempt.
        out = self.svc.admit_or_wait(
            job.tenant, rid, "", req.prompt, max_tokens, "", POOL,
            retry_key=job.retry_key if self._retry_keys else "",
            attempt=job.attempts - 1 if self._retry_keys else 0,
        )  # fmt: skip
        if isinstance(out, AdmitDecision):
            self._answer(job, out)
        else:
            out.on_done = lambda d, job=job: self._answer(job, d)

    def completed(self, job: Job) -> None:
        req = job.req
        # what burstgate's sidecar reports: when the first token came
        first = req.first_token_ns if self._first_tokens else 0
        self.svc.complete(job.tenant, self._rid.pop(str(req.key)), 0, req.prompt, req.output,
                          first_token_ns=first)  # fmt: skip

    def report(self, engine: Engine) -> None:
        p = engine.p
        # What a vLLM sidecar reports: an unbounded waiting queue (capacity
        # 0), and the prefix-cache miss rate it measured (None without a
        # prefix cache, or before any lookup).
        self.svc.report_load(
            POOL, f"engine-{engine.engine_id}", engine.last_batch_tokens if engine.busy else 0,
            p.max_num_batched_tokens, engine.num_waiting, 0, engine.miss_rate_reported,
            1.0 if engine.busy else 0.0,
            requests_running=engine.num_running, max_num_seqs=p.max_num_seqs,
            kv_cache_usage=engine.kv_usage,
        )  # fmt: skip

    def pool_demand(self) -> PoolDemand:
        """What the plane says the simulated pool needs (the autoscaler's signal)."""
        return self.svc.views.pool_demand(POOL)

    def next_wakeup_ns(self) -> int | None:
        return self.svc.next_wakeup_ns()

    def tick(self) -> None:
        self.svc.tick()


def default_tenant_configs(
    rates: dict[str, TenantRates],
    lanes: dict[str, str],
    factor: float = 1.5,
    burst_s: float = 2.0,
) -> list[TenantConfig]:
    """burstgate's tenants for the simulation: token rate ``factor`` x the
    tenant's mean token rate, burst ``burst_s`` seconds of it."""
    out = []
    for tenant, r in sorted(rates.items()):
        rate = max(1.0, r.tokens_per_s * factor)
        out.append(
            TenantConfig(
                tenant_id=tenant,
                token_rate=Decimal(str(round(rate, 3))),
                burst_tokens=max(1, int(rate * burst_s)),
                default_lane=lanes[tenant],
            )
        )
    return out


def from_config_file(path: Path, name: str) -> Burstgate:
    """A burstgate policy from a YAML config file (lanes and tenants, the
    ``burstgate config apply`` format)."""
    from controlplane.configfile import load

    cfg = load(path)
    lanes = [LaneConfig(**spec.model_dump()) for spec in cfg.lanes] or list(DEFAULT_LANES)
    tenants = [TenantConfig(**spec.model_dump()) for spec in cfg.tenants]
    return Burstgate(tenants, lanes, name=name)
