"""``simulate``: load a trace, scale it to a load, run each policy, summarise."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_S
from controlplane.sim.engine import EngineParams
from controlplane.sim.harness import (
    DEFAULT_TENANTS,
    AdmissionPolicy,
    ClientModel,
    Runner,
    TenantSpec,
    estimate_capacity_rps,
)
from controlplane.sim.policies import (
    Burstgate,
    Fifo,
    RequestRateLimit,
    default_tenant_configs,
    from_config_file,
    tenant_rates,
)
from controlplane.sim.report import RunStats, summarise
from controlplane.sim.trace import (
    ColumnMap,
    TraceRequest,
    assign_tenants,
    inject_burst,
    load_trace,
    scale_to_rate,
)


class PolicyName(StrEnum):
    FIFO = "fifo"
    RATE_LIMIT = "rate-limit"
    BURSTGATE = "burstgate"
    # Accepted by --policy, not run by default: burstgate with the pool gate
    # off (Policy.pool_gate=false), what the default was before the gate.
    BURSTGATE_UNGATED = "burstgate-ungated"


BUILTIN_POLICIES = ("fifo", "rate-limit", "burstgate")
EXTRA_POLICIES = tuple(p.value for p in PolicyName if p.value not in BUILTIN_POLICIES)


@dataclass(frozen=True, slots=True)
class Burst:
    tenant: str
    factor: float
    start_s: float
    duration_s: float


@dataclass(slots=True)
class SimSpec:
    trace: Path
    columns: ColumnMap | None = None
    policies: tuple[str, ...] = BUILTIN_POLICIES
    configs: tuple[Path, ...] = ()  # extra burstgate policies from config files
    loads: tuple[float, ...] = (1.0,)
    engines: int = 1
    params: EngineParams = field(default_factory=EngineParams)
    tenants: tuple[TenantSpec, ...] = DEFAULT_TENANTS
    slo_s: dict[str, float] = field(default_factory=dict)
    retries: bool = False
    burst: Burst | None = None
    seed: int = 0
    limit: int | None = None
    rate_factor: float = 1.5  # tenant limits: x the tenant's mean rate
    burst_s: float = 2.0  # tenant bursts: seconds of that rate


def prepare_trace(spec: SimSpec) -> list[TraceRequest]:
    trace = load_trace(spec.trace, spec.columns, limit=spec.limit)
    return assign_tenants(trace, {t.name: t.share for t in spec.tenants}, seed=spec.seed)


def make_policy(name: str, spec: SimSpec, scaled: list[TraceRequest]) -> AdmissionPolicy:
    rates = tenant_rates(scaled)
    if name == "fifo":
        return Fifo()
    if name == "rate-limit":
        return RequestRateLimit(rates, spec.rate_factor, spec.burst_s)
    if name in ("burstgate", "burstgate-ungated"):
        lanes = {t.name: t.lane for t in spec.tenants}
        tenants = default_tenant_configs(rates, lanes, spec.rate_factor, spec.burst_s)
        policy = Policy(pool_gate=False) if name == "burstgate-ungated" else None
        return Burstgate(tenants, policy=policy, name=name)
    known = ", ".join((*BUILTIN_POLICIES, *EXTRA_POLICIES))
    raise ValueError(f"policy: unknown {name!r}; known: {known}")


def simulate(spec: SimSpec) -> list[RunStats]:
    trace = prepare_trace(spec)
    if len(trace) < 2:
        raise ValueError(f"{spec.trace}: a simulation needs at least 2 requests")
    per_engine_rps = estimate_capacity_rps(trace, spec.params, seed=spec.seed)
    pool_rps = per_engine_rps * spec.engines
    mean_tokens = sum(r.prompt_tokens + r.output_tokens for r in trace) / len(trace)
    runs: list[RunStats] = []
    for load in spec.loads:
        scaled = scale_to_rate(trace, load * pool_rps)
        if spec.burst is not None:
            b = spec.burst
            scaled = inject_burst(
                scaled, b.tenant, b.factor, b.start_s, b.duration_s, seed=spec.seed
            )
        policies: list[AdmissionPolicy] = [make_policy(n, spec, scaled) for n in spec.policies]
        policies += [from_config_file(p, f"config:{p.name}") for p in spec.configs]
        for policy in policies:
            result = Runner(
                scaled, policy, engines=spec.engines, params=spec.params,
                tenants=spec.tenants, slo_s=spec.slo_s,
                client=ClientModel(retries=spec.retries), seed=spec.seed,
            ).run()  # fmt: skip
            result.capacity_rps = pool_rps
            window = None
            if spec.burst is not None:
                start = int(spec.burst.start_s * NS_PER_S)
                window = (start, start + int(spec.burst.duration_s * NS_PER_S))
            runs.append(summarise(result, load, pool_rps * mean_tokens, window))
    return runs
