"""Load profiles: a rate over time in named phases, the arrivals they give,
and the requests that arrive.

- **pulse**: ``base`` requests/s with a ``peak`` of ``pulse_s`` every
  ``cycle_s`` (SPEC section 6: e.g. 20 -> 80 QPS for 30 s every 90 s). Each
  cycle is base, then the pulse at its end; the first ``recovery_s`` (the
  pulse's length by default) after a pulse are the **recovery** phase, at
  the base rate, so the report shows how the stack comes back.
- **step**: warm-up at ``base``, one burst at ``peak``, recovery at ``base``.
- **constant**: one rate throughout.

Arrivals are open loop (nobody waits for an answer before sending the
next): Poisson by default, or evenly spaced (``uniform``) for exact counts.
Everything is drawn from one seeded generator: the same options give the
same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# The longest run the command accepts (it stops by itself at its end).
MAX_TOTAL_S = 3600.0
MAX_RATE = 50_000.0


@dataclass(frozen=True, slots=True)
class Phase:
    name: str  # base | pulse | recovery | warmup | burst | constant
    start_s: float
    end_s: float
    rate: float  # requests per second


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant of the load, its lane ("" = the tenant's default) and weight;
    ``max_request_tokens``: no request of it is larger (prompt + output),
    the tenant's ``max_tokens_per_request`` when it is known (demofit.py)."""

    tenant_id: str
    lane: str = ""
    weight: float = 1.0
    max_request_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Mix:
    """Request lengths: a share of long prompts and of long outputs."""

    long_prompt_share: float = 0.2
    long_output_share: float = 0.2
    prompt: tuple[int, int] = (200, 1_000)
    long_prompt: tuple[int, int] = (4_000, 8_000)
    output: tuple[int, int] = (50, 300)
    long_output: tuple[int, int] = (800, 1_500)


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    phase: str
    tenant: Tenant
    prompt_tokens: int
    max_tokens: int


def _check(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"--{name}: must be in [{low:g}, {high:g}], got {value:g}")


def pulse(
    base: float, peak: float, pulse_s: float, cycle_s: float, total_s: float,
    recovery_s: float | None = None,
) -> list[Phase]:  # fmt: skip
    for name, v, hi in (("base", base, MAX_RATE), ("peak", peak, MAX_RATE),
                        ("total-s", total_s, MAX_TOTAL_S)):  # fmt: skip
        _check(name, v, 0, hi)
    if not 0 < pulse_s < cycle_s:
        raise ValueError(f"--pulse-s: must be > 0 and < --cycle-s ({cycle_s:g}), got {pulse_s:g}")
    quiet = cycle_s - pulse_s
    recovery = min(quiet, pulse_s if recovery_s is None else recovery_s)
    phases: list[Phase] = []
    t, first = 0.0, True
    while t < total_s:
        if not first and recovery > 0:
            phases.append(Phase("recovery", t, t + recovery, base))
            phases.append(Phase("base", t + recovery, t + quiet, base))
        else:
            phases.append(Phase("base", t, t + quiet, base))
        phases.append(Phase("pulse", t + quiet, t + cycle_s, peak))
        t += cycle_s
        first = False
    return _clip(phases, total_s)


def step(base: float, peak: float, warmup_s: float, burst_s: float,
         recovery_s: float) -> list[Phase]:  # fmt: skip
    _check("base", base, 0, MAX_RATE)
    _check("peak", peak, 0, MAX_RATE)
    _check("total-s", warmup_s + burst_s + recovery_s, 0, MAX_TOTAL_S)
    a, b = warmup_s, warmup_s + burst_s
    phases = (Phase("warmup", 0, a, base), Phase("burst", a, b, peak),
              Phase("recovery", b, b + recovery_s, base))  # fmt: skip
    return [p for p in phases if p.end_s > p.start_s]


def constant(rate: float, total_s: float) -> list[Phase]:
    _check("base", rate, 0, MAX_RATE)
    _check("total-s", total_s, 0, MAX_TOTAL_S)
    return [Phase("constant", 0, total_s, rate)]


def _clip(phases: list[Phase], total_s: float) -> list[Phase]:
    out = []
    for p in phases:
        if p.start_s >= total_s or p.end_s <= p.start_s:
            continue
        out.append(Phase(p.name, p.start_s, min(p.end_s, total_s), p.rate))
    return out


def arrivals(
    phases: list[Phase], tenants: list[Tenant], mix: Mix, *, seed: int = 0,
    uniform: bool = False,
) -> list[Arrival]:  # fmt: skip
    """Every request of the run, in time order."""
    if not tenants:
        raise ValueError("--tenant: at least one")
    rng = random.Random(seed)
    weights = [t.weight for t in tenants]
    out: list[Arrival] = []
    for p in phases:
        if p.rate <= 0:
            continue
        t, k = p.start_s, 0
        while True:
            k += 1
            # evenly spaced: k / rate from the start (no summed rounding error)
            t = p.start_s + k / p.rate if uniform else t + rng.expovariate(p.rate)
            if t >= p.end_s - 1e-9:
                break
            tenant = rng.choices(tenants, weights)[0]
            cap = tenant.max_request_tokens
            lo, hi = mix.long_prompt if rng.random() < mix.long_prompt_share else mix.prompt
            if cap:  # leave room for the shortest output
                lo, hi = _within(lo, hi, cap - mix.output[0])
            prompt = rng.randint(lo, hi)
            lo, hi = mix.long_output if rng.random() < mix.long_output_share else mix.output
            if cap:
                lo, hi = _within(lo, hi, cap - prompt)
            out.append(Arrival(t, p.name, tenant, prompt, rng.randint(lo, hi)))
    return out


def _within(lo: int, hi: int, most: int) -> tuple[int, int]:
    """The range lo..hi cut to at most ``most`` (and at least 1): a capped
    tenant's long request is as long as its cap allows."""
    hi = max(1, min(hi, most))
    return min(lo, hi), hi
