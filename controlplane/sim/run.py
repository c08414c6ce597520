"""``simulate``: load a trace, scale it to a load, run each policy, summarise.

For each prefill slowdown the pool's capacity is measured on the engines
actually modelled (``estimate_capacity_rps``), and each load is a multiple
of it: "1.0x" always means the modelled engines' capacity. Every policy at
one (load, slowdown) sees exactly the same arrivals; the premium-only bound
sees the premium tenants' share of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from pathlib import Path

from controlplane.domain.autoscaler import (
    DEFAULT_ENGINE_STARTUP_S,
    DEFAULT_SCALE_DOWN_DELAY_S,
    ScalerParams,
)
from controlplane.domain.catalog import PriceEntry
from controlplane.domain.policy import Policy
from controlplane.domain.pricing import StepTable
from controlplane.domain.units import NS_PER_S
from controlplane.ledger.pricing import PricingBook
from controlplane.settings import Settings
from controlplane.sim.engine import EngineParams
from controlplane.sim.harness import (
    DEFAULT_TENANTS,
    AdmissionPolicy,
    ClientKind,
    ClientModel,
    Runner,
    TenantSpec,
    estimate_capacity_rps,
)
from controlplane.sim.policies import (
    Burstgate,
    DropLate,
    Fifo,
    RequestRateLimit,
    default_tenant_configs,
    from_config_file,
    tenant_rates,
)
from controlplane.sim.profiles import DEFAULT_PROFILE
from controlplane.sim.report import RunStats, mark_best, summarise
from controlplane.sim.reuse import DEFAULT_PRICE, reuse_stats
from controlplane.sim.scaling import NEEDS_DEMAND, AutoscaleMode, ScalingLoop
from controlplane.sim.synthetic import (
    DEFAULT_BLOCK_TOKENS,
    bind_system_prompts,
    generate,
    parse_spec,
    per_second_stats,
)
from controlplane.sim.trace import (
    ColumnMap,
    TraceRequest,
    assign_tenants,
    inject_burst,
    load_trace,
    scale_to_rate,
)

# A trace file's block ids: Mooncake's 512 tokens unless --block-tokens says.
FILE_BLOCK_TOKENS = 512
# The plane's own defaults (BURSTGATE_PRICING_WINDOW_S, _PRICING_STEPS).
PLANE_WINDOW_S: int = Settings.model_fields["pricing_window_s"].default
PLANE_STEPS: list[tuple[Decimal, Decimal]] = Settings.model_fields["pricing_steps"].default


class PolicyName(StrEnum):
    """What --policy accepts, in the order --help lists it (the policies
    before the baselines); the default runs and their table order are
    BUILTIN_POLICIES."""

    FIFO = "fifo"
    RATE_LIMIT = "rate-limit"
    BURSTGATE = "burstgate"
    # Accepted by --policy, not run by default: burstgate with the pool gate
    # off (Policy.pool_gate=false), what the default was before the gate.
    BURSTGATE_UNGATED = "burstgate-ungated"
    DROP_LATE = "drop-late"
    # The premium tenants' requests alone, FIFO into the engines with
    # drop-late's abort: the premium attainment to hold a policy to (a
    # reference, not a policy). Plain FIFO is no bound once premium alone
    # overloads the pool (heavy-burst's bursts): a policy that refuses some
    # premium requests then gets more of the others in time, so late ones
    # are dropped here too, as the strongest simple reference.
    PREMIUM_ONLY = "premium-only"


BUILTIN_POLICIES = ("fifo", "rate-limit", "drop-late", "burstgate", "premium-only")
EXTRA_POLICIES = tuple(p.value for p in PolicyName if p.value not in BUILTIN_POLICIES)
BOUND = PolicyName.PREMIUM_ONLY.value


@dataclass(frozen=True, slots=True)
class Burst:
    tenant: str
    factor: float
    start_s: float
    duration_s: float


@dataclass(slots=True)
class SimSpec:
    trace: str | Path  # a file, or synthetic:NAME[:SEED[:DURATION_S]]
    columns: ColumnMap | None = None
    policies: tuple[str, ...] = BUILTIN_POLICIES
    configs: tuple[Path, ...] = ()  # extra burstgate policies from config files
    loads: tuple[float, ...] = (1.0,)
    engines: int = 1
    params: EngineParams = field(default_factory=EngineParams)
    profile: str = DEFAULT_PROFILE  # what ``params`` are, for the reports
    prefill_slowdowns: tuple[float, ...] = (1.0,)  # x the profile's prefill cost
    tenants: tuple[TenantSpec, ...] = DEFAULT_TENANTS
    slo_s: dict[str, float] = field(default_factory=dict)
    client: ClientKind = ClientKind.NONE
    # Retries carry a retry key (what burstgate's sidecar and SDK send), so
    # the plane judges them against their first attempt's deadline; off:
    # every attempt looks like a new request to it.
    retry_keys: bool = True
    # Completes carry the request's first-token time (what burstgate's
    # sidecar measures and reports); off: the plane never learns it.
    first_tokens: bool = True
    burst: Burst | None = None
    seed: int = 0
    limit: int | None = None
    rate_factor: float = 1.5  # tenant limits: x the tenant's mean rate
    burst_s: float = 2.0  # tenant bursts: seconds of that rate
    # Autoscalers to run each policy under (sim/scaling.py); "off": a fixed
    # pool of ``engines``. The others start at ``min_engines`` and never
    # exceed ``engines``.
    autoscale: tuple[str, ...] = (AutoscaleMode.OFF.value,)
    min_engines: int = 1
    engine_startup_s: float = DEFAULT_ENGINE_STARTUP_S
    scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S
    # The prefix cache (engine.py, prefixcache.py): on when the trace has
    # block ids; tokens per block id (None: a file's 512, a synthetic
    # trace's own 64).
    prefix_cache: bool = True
    block_tokens: int | None = None
    # The plane's pricing windows and steps the engines' miss rates feed,
    # and the price both ledgers use (reuse.py).
    pricing_window_s: int = PLANE_WINDOW_S
    pricing_steps: list[tuple[Decimal, Decimal]] = field(default_factory=lambda: list(PLANE_STEPS))
    price: PriceEntry = DEFAULT_PRICE

    def unit_tokens(self) -> int:
        """Tokens per block id of this spec's trace."""
        if self.block_tokens is not None:
            return self.block_tokens
        return DEFAULT_BLOCK_TOKENS if parse_spec(str(self.trace)) else FILE_BLOCK_TOKENS

    def scaler_params(self) -> ScalerParams:
        return ScalerParams(
            min_engines=self.min_engines, max_engines=self.engines,
            engine_startup_s=self.engine_startup_s, scale_down_delay_s=self.scale_down_delay_s,
        )  # fmt: skip


def prepare_trace(spec: SimSpec) -> list[TraceRequest]:
    if spec.block_tokens is not None and spec.block_tokens < 1:
        raise ValueError(f"--block-tokens: must be >= 1, got {spec.block_tokens}")
    synthetic = parse_spec(str(spec.trace))
    if synthetic is not None:
        name, seed, duration = synthetic
        trace = generate(name, seed=seed, duration_s=duration, block_tokens=spec.unit_tokens())
        trace = trace[: spec.limit]
    else:
        trace = load_trace(spec.trace, spec.columns, limit=spec.limit)
        check_blocks(trace, spec.unit_tokens())
    trace = assign_tenants(trace, {t.name: t.share for t in spec.tenants}, seed=spec.seed)
    if synthetic is not None:
        trace = bind_system_prompts(synthetic[0], synthetic[1], trace, spec.unit_tokens())
    return trace


def check_blocks(trace: list[TraceRequest], unit_tokens: int) -> None:
    """A request cannot have more block ids than its prompt has blocks: a
    wrong --block-tokens, said before a run that takes minutes."""
    for r in trace:
        if len(r.blocks) > -(-r.prompt_tokens // unit_tokens):
            raise ValueError(
                f"--block-tokens: row {r.row} has {len(r.blocks)} block ids for a "
                f"{r.prompt_tokens}-token prompt, more than {unit_tokens}-token blocks allow; "
                "give the trace's block size with --block-tokens"
            )


def prefix_unit(spec: SimSpec, trace: list[TraceRequest]) -> int | None:
    """Tokens per block id to cache prefixes by, or None: no prefix cache
    (turned off, or no request has block ids)."""
    if not spec.prefix_cache or not any(r.blocks for r in trace):
        return None
    unit = spec.unit_tokens()
    if unit % spec.params.block_size:
        raise ValueError(
            f"--block-tokens: must be a multiple of the engine's block_size "
            f"({spec.params.block_size}), got {unit}"
        )
    return unit


def premium_only(spec: SimSpec, scaled: list[TraceRequest]) -> list[TraceRequest]:
    """The premium tenants' requests of ``scaled``, at their own times."""
    premium = {t.name for t in spec.tenants if t.lane == "premium"}
    if not premium:
        raise ValueError("policy premium-only: no tenant is in the premium lane")
    return [r for r in scaled if r.tenant in premium]


def make_policy(name: str, spec: SimSpec, scaled: list[TraceRequest]) -> AdmissionPolicy:
    rates = tenant_rates(scaled)
    if name == "fifo":
        return Fifo()
    if name == BOUND:  # on the premium requests alone (see simulate)
        bound = DropLate()
        bound.name = BOUND
        return bound
    if name == "drop-late":
        return DropLate()
    if name == "rate-limit":
        return RequestRateLimit(rates, spec.rate_factor, spec.burst_s)
    if name in ("burstgate", "burstgate-ungated"):
        lanes = {t.name: t.lane for t in spec.tenants}
        tenants = default_tenant_configs(rates, lanes, spec.rate_factor, spec.burst_s)
        policy = Policy(pool_gate=False) if name == "burstgate-ungated" else None
        return Burstgate(tenants, policy=policy, name=name, retry_keys=spec.retry_keys,
                         first_tokens=spec.first_tokens)  # fmt: skip
    known = ", ".join((*BUILTIN_POLICIES, *EXTRA_POLICIES))
    raise ValueError(f"policy: unknown {name!r}; known: {known}")


def _checked(spec: SimSpec) -> None:
    for x in spec.prefill_slowdowns:
        if not x > 0:
            raise ValueError(f"--prefill-slowdown: must be > 0, got {x:g}")
    for x in spec.loads:
        if not x > 0:
            raise ValueError(f"--load: must be > 0, got {x:g}")
    modes = [AutoscaleMode(m) for m in spec.autoscale]  # ValueError names the value
    if any(m != AutoscaleMode.OFF for m in modes):
        spec.scaler_params()  # its checks, before a run that takes minutes
    if any(m in NEEDS_DEMAND for m in modes) and not _burstgate_runs(spec):
        raise ValueError(
            "--autoscale reactive/predictive: need a burstgate policy (--policy burstgate or "
            "--config), whose desired_engines they follow"
        )


def _burstgate_runs(spec: SimSpec) -> bool:
    return bool(spec.configs) or any(p.startswith("burstgate") for p in spec.policies)


def runs_of(spec: SimSpec) -> list[tuple[str, str]]:
    """(policy, autoscale mode) pairs to run, in table order: each policy
    under each mode it can run (reactive and predictive need burstgate's
    signals; the premium-only bound is a fixed pool's reference)."""
    names = [*spec.policies, *(f"config:{p.name}" for p in spec.configs)]
    out: list[tuple[str, str]] = []
    for mode in spec.autoscale:
        for name in names:
            if mode != AutoscaleMode.OFF and name == BOUND:
                continue
            if AutoscaleMode(mode) in NEEDS_DEMAND and not (
                name.startswith("burstgate") or name.startswith("config:")
            ):
                continue
            out.append((name, mode))
    return out


def simulate(spec: SimSpec, trace: list[TraceRequest] | None = None) -> list[RunStats]:
    """Every (load, prefill slowdown, policy) run; ``trace``: the spec's
    trace already prepared (``prepare_trace``), to read it once."""
    _checked(spec)
    if spec.pricing_window_s < 1:
        raise ValueError(f"--pricing-window-s: must be >= 1, got {spec.pricing_window_s}")
    StepTable(spec.pricing_steps)  # its checks, before a run that takes minutes
    trace = prepare_trace(spec) if trace is None else trace
    if len(trace) < 2:
        raise ValueError(f"{spec.trace}: a simulation needs at least 2 requests")
    mean_tokens = sum(r.prompt_tokens + r.output_tokens for r in trace) / len(trace)
    unit = prefix_unit(spec, trace)
    capacity: dict[float, float] = {}  # per slowdown: the pool's requests/s
    for slowdown in spec.prefill_slowdowns:
        params = spec.params.with_prefill_slowdown(slowdown)
        capacity[slowdown] = spec.engines * estimate_capacity_rps(
            trace, params, seed=spec.seed, prefix_unit_tokens=unit
        )
    window = None
    if spec.burst is not None:
        start = int(spec.burst.start_s * NS_PER_S)
        window = (start, start + int(spec.burst.duration_s * NS_PER_S))
    runs: list[RunStats] = []
    for load in spec.loads:
        for slowdown in spec.prefill_slowdowns:
            params = spec.params.with_prefill_slowdown(slowdown)
            pool_rps = capacity[slowdown]
            scaled = scale_to_rate(trace, load * pool_rps)
            if spec.burst is not None:
                b = spec.burst
                scaled = inject_burst(
                    scaled, b.tenant, b.factor, b.start_s, b.duration_s, seed=spec.seed
                )
            arrivals = per_second_stats(scaled)
            group: list[RunStats] = []
            configs = {f"config:{p.name}": p for p in spec.configs}
            for name, mode in runs_of(spec):
                policy: AdmissionPolicy
                if name in configs:
                    policy = from_config_file(configs[name], name)
                else:
                    policy = make_policy(name, spec, scaled)
                scaling = None
                if mode != AutoscaleMode.OFF:
                    if isinstance(policy, Burstgate):
                        policy.engine_startup_s = spec.engine_startup_s
                    scaling = ScalingLoop(AutoscaleMode(mode), spec.scaler_params(), policy)
                pricing = None
                if unit is not None:
                    pricing = PricingBook(spec.pricing_window_s, StepTable(spec.pricing_steps))
                result = Runner(
                    premium_only(spec, scaled) if name == BOUND else scaled, policy,
                    engines=spec.engines, params=params, tenants=spec.tenants,
                    slo_s=spec.slo_s, client=ClientModel(spec.client), seed=spec.seed,
                    scaling=scaling, prefix_unit_tokens=unit, pricing=pricing,
                ).run()  # fmt: skip
                result.capacity_rps = pool_rps
                stats = summarise(result, load, pool_rps * mean_tokens, window)
                stats.reuse = reuse_stats(result, spec.price, window)
                stats.autoscale = mode
                stats.bound = name == BOUND
                stats.prefill_slowdown = slowdown
                stats.profile = spec.profile
                stats.client = str(spec.client)
                stats.arrivals_cv = arrivals.cv
                stats.arrivals_peak_to_mean = arrivals.peak_to_mean
                group.append(stats)
            mark_best(group)
            runs += group
    return runs
