"""The default tenants of ``loadtest`` and ``replay``, fitted to the demo's
limits (controlplane/demo.yaml) rather than sent blind.

Before, both sent a third (replay: 30 %) of the load to ``free-tier``,
whose limits are a small tenant's (200 tokens/s, at most 2,048 tokens a
request), with prompts of up to 8,000 tokens: about a third of the default
load was refused before the first pulse, so the pulse measured nothing the
base load had not already broken. Now, from the config's own figures, not
new constants:

- **weights**: each tenant's share of the requests is its share of the
  demo's summed ``token_rate``, so the base load reaches every tenant in
  proportion to what it may use (acme ~79 %, agentco ~20 %, free-tier
  ~1 %), and a tenant's refusals in a pulse are the pulse's doing;
- **lengths**: ``loadtest`` draws no request larger than the tenant's
  ``max_tokens_per_request`` (profile.Tenant.max_request_tokens);
  ``replay`` keeps the trace's lengths and gives a row only to a tenant
  whose cap it fits (replay.plan).

The lanes stay one per tenant (premium, standard, batch), so that every lane
is exercised. ``--tenant`` replaces all this: the tenants named are sent as
given, with no cap (the load generator does not know another server's
limits).
"""

from __future__ import annotations

from pathlib import Path

from controlplane.loadtest.profile import Mix, Tenant

# The demo's tenants, one per lane (the tenants' own default lanes would
# leave premium without traffic).
DEMO_LANES = (("acme", "premium"), ("agentco", "standard"), ("free-tier", "batch"))


def demo_tenants(path: Path | None = None) -> list[Tenant]:
    """The demo's three tenants weighted by token rate, each with its
    per-request cap, from the demo config (``path``: another config file
    with tenants of the same names)."""
    from controlplane.configfile import DEMO_CONFIG, load

    cfg = load(path or DEMO_CONFIG)
    by_id = {t.tenant_id: t for t in cfg.tenants}
    missing = [tid for tid, _ in DEMO_LANES if tid not in by_id]
    if missing:
        raise ValueError(f"the demo config has no tenant {', '.join(missing)}")
    return [
        Tenant(tid, lane, float(by_id[tid].token_rate), by_id[tid].max_tokens_per_request)
        for tid, lane in DEMO_LANES
    ]


def describe(tenants: list[Tenant]) -> str:
    """``acme:premium 79%, ...``: the mix a run uses, for its first line."""
    total = sum(t.weight for t in tenants)
    return ", ".join(
        f"{t.tenant_id}:{t.lane} {100 * t.weight / total:.0f}%"
        + (f" (<= {t.max_request_tokens:,} tokens)" if t.max_request_tokens else "")
        for t in tenants
    )


# With --local the engine is the fake one, whose capacity is known: the base
# rate is half of what it sustains on the run's length mix (no request is
# refused for the engine's sake before the first pulse), a pulse twice it
# (the overload the pulse is there to show). Against another server its
# engines are unknown and SPEC section 6's 20 -> 80 requests/s apply.
BASE_OF_CAPACITY = 0.5
PEAK_OF_CAPACITY = 2.0
SPEC_BASE_RPS, SPEC_PEAK_RPS = 20.0, 80.0


def local_capacity_rps(
    tenants: list[Tenant], mix: Mix, engine_speed: float, seed: int = 0
) -> float:
    """Requests per second the fake engine of ``--local`` (the simulator's
    default engine, at ``engine_speed`` model seconds per wall second)
    sustains on the lengths this run draws: the simulator's own estimate
    (sim.harness.estimate_capacity_rps), on a sample of the run's requests
    with every request taking its full ``max_tokens`` (the engine's worst
    case: the estimate errs low)."""
    from controlplane.loadtest.profile import arrivals, constant
    from controlplane.sim.engine import EngineParams
    from controlplane.sim.harness import estimate_capacity_rps
    from controlplane.sim.trace import TraceRequest

    sample = arrivals(constant(100.0, 20.0), tenants, mix, seed=seed)
    trace = [TraceRequest(int(a.at_s * 1e9), a.prompt_tokens, a.max_tokens, a.tenant.tenant_id, i)
             for i, a in enumerate(sample)]  # fmt: skip
    return estimate_capacity_rps(trace, EngineParams(), seed=seed) * engine_speed


def default_rates(
    base: float | None, peak: float | None, local: bool, capacity: float | None
) -> tuple[float, float]:
    """--base and --peak as given, else fitted to the local engine's
    ``capacity`` (with --local) or SPEC section 6's."""
    if local and capacity is not None:
        fit_base, fit_peak = BASE_OF_CAPACITY * capacity, PEAK_OF_CAPACITY * capacity
    else:
        fit_base, fit_peak = SPEC_BASE_RPS, SPEC_PEAK_RPS
    return (
        base if base is not None else round(fit_base, 1),
        peak if peak is not None else round(max(fit_peak, base or 0.0), 1),
    )
