"""What a run's prefix caches did, and what it did to the bill.

Per lane (served requests): prompt tokens, the tokens found cached when each
request first started (vLLM's ``cached_tokens``), the hit rate, and the
prefill tokens the engines computed for them (a preempted request computes
its prompt again) over the prompt tokens asked.

Per pricing window (``[k * window_s, (k+1) * window_s)`` of simulated time,
the plane's windows with the run starting at the epoch):

- **over time**, from the engines' counters: the hit rate of the lookups in
  the window (tokens found / tokens looked up), prefill tokens computed over
  tokens looked up, prefill step time per 1,000 tokens looked up; the miss
  rate the engines reported (mean of their load reports) and the multiplier
  the plane's pricing windows had in force (set by the previous window's
  reported rate, ``controlplane.ledger.pricing.PricingBook``);
- **billing**, over the requests settled (completed) in the window, with the
  dual ledger's own functions (``controlplane.domain.catalog.user_charge``
  and ``actual_cost``, each rounded to nano-units as the ledger does): the
  actual cost (the request's own miss rate), the user charge at a **fixed**
  price (multiplier 1) and at the **dynamic** price (the multiplier quoted
  when the request was released), and each one's cost / charge.
- **drift**: a window's cost / charge over the reference, minus one: how
  far the price strayed from what the GPU spent (+10 %: that window cost
  10 % more per unit charged; -10 %: the user paid 10 % more per unit of
  cost). The reference is the fixed price's median cost / charge over the
  windows before an injected burst (the margin the price list gives in the
  steady state the burst breaks), or over every window when there is no
  burst (or no window before it); fixed and dynamic prices are judged
  against the same one. The burst's drift is the mean |drift| of the
  windows overlapping it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from decimal import Decimal

from controlplane.domain.catalog import ANY, PriceEntry, actual_cost, user_charge
from controlplane.domain.money import ppm_decimal, rate_ppm, to_nanos
from controlplane.domain.units import NS_PER_S, PPM
from controlplane.sim.harness import SERVED, Job, SimResult

ONE = Decimal(1)
# What simulate charges and costs with unless told (--price): burstgate
# demo's price list (cli/serve.py), except that cached prompt tokens are
# charged as any other (a fixed price per token: what the issue measures
# drift against). USD per million tokens; overhead per request.
DEFAULT_PRICE = PriceEntry(
    ANY, ANY, "USD",
    input_per_mtok=Decimal("0.50"), cached_input_per_mtok=Decimal("0.50"),
    output_per_mtok=Decimal("1.50"), gpu_prefill_per_mtok=Decimal("0.20"),
    gpu_decode_per_mtok=Decimal("0.80"), gpu_overhead_per_request=Decimal("0.00002"),
)  # fmt: skip
PRICE_KEYS = {
    "input": "input_per_mtok",
    "cached_input": "cached_input_per_mtok",
    "output": "output_per_mtok",
    "gpu_prefill": "gpu_prefill_per_mtok",
    "gpu_decode": "gpu_decode_per_mtok",
    "gpu_overhead": "gpu_overhead_per_request",
}


@dataclass(slots=True)
class LaneReuse:
    requests: int  # served
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_computed: int
    computed_over_asked: float  # prefill_computed / prompt_tokens


@dataclass(slots=True)
class WindowReuse:
    start_s: float
    lookups_tokens: int  # prompt tokens looked up in the cache
    hit_rate: float  # NaN: no lookup
    computed_over_asked: float
    prefill_ms_per_ktok: float  # prefill step time per 1,000 tokens looked up
    miss_reported: float  # mean of the engines' reports; NaN: none
    multiplier: float  # in force during the window
    settled: int  # requests completed in the window
    cost: float  # currency units
    charge_fixed: float
    charge_dynamic: float
    ratio_fixed: float  # cost / charge
    ratio_dynamic: float
    drift_fixed: float = float("nan")
    drift_dynamic: float = float("nan")


@dataclass(slots=True)
class ReuseStats:
    block_tokens: int
    window_s: int
    currency: str
    hit_rate: float  # over every served request
    computed_over_asked: float
    lanes: dict[str, LaneReuse]
    windows: list[WindowReuse]
    max_drift_fixed: float  # the largest |drift| of a window
    max_drift_dynamic: float
    # Windows overlapping an injected burst: their mean |drift| (NaN: none).
    burst_drift_fixed: float = float("nan")
    burst_drift_dynamic: float = float("nan")
    burst_windows: list[float] = field(default_factory=list)  # their start_s


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _lane(jobs: list[Job]) -> LaneReuse:
    prompt = sum(j.req.prompt for j in jobs)
    cached = sum(max(0, j.req.cached_tokens) for j in jobs)
    computed = sum(j.req.prefill_computed for j in jobs)
    return LaneReuse(len(jobs), prompt, cached, _ratio(cached, prompt), computed,
                     _ratio(computed, prompt))  # fmt: skip


def request_miss(job: Job) -> Decimal:
    """The request's own miss rate, to the ledger's 6 decimals."""
    req = job.req
    cached = min(max(0, req.cached_tokens), req.prompt)
    return ppm_decimal(rate_ppm(1 - cached / req.prompt)) if req.prompt else Decimal(0)


def _bill(job: Job, price: PriceEntry, dynamic: Decimal) -> tuple[int, int, int]:
    """(actual cost, charge at multiplier 1, charge at ``dynamic``) in nano-units."""
    req = job.req
    cached = min(max(0, req.cached_tokens), req.prompt)
    lane = price.lane_multiplier(job.lane)
    cost = to_nanos(actual_cost(price, req.prompt, req.output, request_miss(job)))
    fixed = to_nanos(user_charge(price, req.prompt, cached, req.output, ONE, lane))
    dyn = to_nanos(user_charge(price, req.prompt, cached, req.output, dynamic, lane))
    return cost, fixed, dyn


def reuse_stats(
    result: SimResult,
    price: PriceEntry = DEFAULT_PRICE,
    burst_ns: tuple[int, int] | None = None,
) -> ReuseStats | None:
    """The run's reuse, per lane and window, and its billing drift; None
    when the run modelled no prefix cache or had no pricing windows."""
    book = result.pricing
    if result.prefix_unit_tokens is None or book is None:
        return None
    served = [j for j in result.jobs if j.outcome == SERVED]
    by_lane: dict[str, list[Job]] = {}
    for j in served:
        by_lane.setdefault(j.lane, []).append(j)
    lanes = {lane: _lane(jobs) for lane, jobs in sorted(by_lane.items())}
    overall = _lane(served)

    window_ns = book.window_ns
    n_windows = max(1, -(-max(1, result.duration_ns) // window_ns))
    # the engines' counters at each window boundary (samples are every second)
    at: dict[int, tuple[int, int, int, float]] = {}
    for s in result.samples:
        at.setdefault(s.t_ns, (s.prefix_queries, s.prefix_hits, s.prefill_tokens, s.prefill_us))
    last = result.samples[-1] if result.samples else None
    end_counts = (
        (last.prefix_queries, last.prefix_hits, last.prefill_tokens, last.prefill_us)
        if last else (0, 0, 0, 0.0)
    )  # fmt: skip

    def counts(t_ns: int) -> tuple[int, int, int, float]:
        return at.get(t_ns, end_counts)

    # per window, as the plane's book recorded it: the miss rate measured
    # (the mean of the engines' reports) and the multiplier in force
    in_force: dict[int, float] = {}
    measured: dict[int, float] = {}
    for w in book.snapshot(n_windows * window_ns):
        k = w.window_start_s // book.window_s
        in_force[k] = float(w.multiplier)
        if w.miss_rate_ppm is not None:
            measured[k] = w.miss_rate_ppm / PPM
    bills: dict[int, list[int]] = {}
    for j in served:
        k = min(j.req.done_ns // window_ns, n_windows - 1)
        cost, fixed, dyn = _bill(j, price, book.multiplier_decimal(j.multiplier))
        acc = bills.setdefault(k, [0, 0, 0, 0])
        acc[0] += 1
        acc[1] += cost
        acc[2] += fixed
        acc[3] += dyn

    windows: list[WindowReuse] = []
    for k in range(n_windows):
        q0, h0, p0, u0 = counts(k * window_ns)
        q1, h1, p1, u1 = counts((k + 1) * window_ns)
        q = q1 - q0
        n, cost, fixed, dyn = bills.get(k, [0, 0, 0, 0])
        windows.append(WindowReuse(
            start_s=k * window_ns / NS_PER_S, lookups_tokens=q,
            hit_rate=_ratio(h1 - h0, q), computed_over_asked=_ratio(p1 - p0, q),
            prefill_ms_per_ktok=_ratio((u1 - u0) / 1_000, q / 1_000),
            miss_reported=measured.get(k, float("nan")),
            multiplier=in_force.get(k, 1.0), settled=n,
            cost=cost / 1e9, charge_fixed=fixed / 1e9, charge_dynamic=dyn / 1e9,
            ratio_fixed=_ratio(cost, fixed), ratio_dynamic=_ratio(cost, dyn),
        ))  # fmt: skip
    before = None
    if burst_ns is not None:
        before = [w for w in windows if (w.start_s + book.window_s) * NS_PER_S <= burst_ns[0]]
    _drift(windows, before or windows)
    stats = ReuseStats(
        block_tokens=result.prefix_unit_tokens, window_s=book.window_s, currency=price.currency,
        hit_rate=overall.hit_rate, computed_over_asked=overall.computed_over_asked,
        lanes=lanes, windows=windows,
        max_drift_fixed=max((abs(w.drift_fixed) for w in windows if w.settled), default=0.0),
        max_drift_dynamic=max((abs(w.drift_dynamic) for w in windows if w.settled), default=0.0),
    )  # fmt: skip
    if burst_ns is not None:
        inside = [
            w for w in windows
            if w.settled and w.start_s * NS_PER_S < burst_ns[1]
            and (w.start_s + book.window_s) * NS_PER_S > burst_ns[0]
        ]  # fmt: skip
        if inside:
            stats.burst_windows = [w.start_s for w in inside]
            stats.burst_drift_fixed = statistics.fmean(abs(w.drift_fixed) for w in inside)
            stats.burst_drift_dynamic = statistics.fmean(abs(w.drift_dynamic) for w in inside)
    return stats


def _drift(windows: list[WindowReuse], reference: list[WindowReuse]) -> None:
    """Each window's cost / charge, fixed and dynamic, against the median
    fixed-price cost / charge of ``reference``: the margin the price list
    gives in steady traffic, which both prices are judged against."""
    ratios = [w.ratio_fixed for w in reference if w.settled and w.ratio_fixed == w.ratio_fixed]
    if not ratios or not (typical := statistics.median(ratios)):
        return
    for w in windows:
        if w.settled:
            w.drift_fixed = w.ratio_fixed / typical - 1
            w.drift_dynamic = w.ratio_dynamic / typical - 1


def parse_price(text: str, base: PriceEntry = DEFAULT_PRICE) -> PriceEntry:
    """``--price input=0.5,cached_input=0.1,...`` over ``base``; the
    catalog's own checks (``validate_entry``), errors naming the key."""
    from dataclasses import replace

    from controlplane.domain.catalog import validate_entry
    from controlplane.domain.errors import InvalidArgument

    values: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or (key not in PRICE_KEYS and key != "currency"):
            raise ValueError(
                f"--price: expected KEY=VALUE with KEY one of "
                f"{', '.join([*PRICE_KEYS, 'currency'])}, got {item!r}"
            )
        if key == "currency":
            values["currency"] = value.strip()
            continue
        try:
            values[PRICE_KEYS[key]] = Decimal(value.strip())
        except ArithmeticError:
            raise ValueError(f"--price: {key}: expected a number, got {value.strip()!r}") from None
    entry = replace(base, **values)  # type: ignore[arg-type]
    try:
        return validate_entry(entry)
    except InvalidArgument as exc:
        raise ValueError(f"--price: {exc}") from None


def parse_steps(text: str) -> list[tuple[Decimal, Decimal]]:
    """``--pricing-steps 0.3:1.2,0.6:1.5`` -> [(threshold, multiplier)]."""
    from controlplane.domain.pricing import StepTable

    steps: list[tuple[Decimal, Decimal]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        t, sep, m = item.partition(":")
        try:
            if not sep:
                raise ArithmeticError
            pair = (Decimal(t.strip()), Decimal(m.strip()))
            if not all(x.is_finite() for x in pair):
                raise ArithmeticError
            steps.append(pair)
        except ArithmeticError:
            raise ValueError(
                f"--pricing-steps: expected MISS_RATE:MULTIPLIER pairs (e.g. 0.3:1.2,0.6:1.5), "
                f"got {item!r}"
            ) from None
    if not steps:
        raise ValueError("--pricing-steps: give at least one MISS_RATE:MULTIPLIER pair")
    try:
        StepTable(steps)  # the plane's own checks
    except (ValueError, ArithmeticError) as exc:
        raise ValueError(f"--pricing-steps: {exc}") from None
    return steps
