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

from controlplane.loadtest.profile import Tenant

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
