"""Sums of ledger rows with the dynamic part of the user charge made visible.

A ledger row keeps the user charge *after* the pricing multiplier locked at
admission (and the lane multiplier). Finance also wants the charge the
request would have had at multiplier 1 (the **base charge**) and the
difference, the **dynamic revenue** the multiplier brought in (negative
for a multiplier below 1).

The ledger does not store the base charge, and the price catalog is edited
in place (a row's ``price_id`` names an entry whose prices may have changed
since), so the base charge is derived from the row itself::

    base_charge = user_charge / pricing_multiplier

rounded half-to-even to 1e-9 of the currency, **per record**, like every
amount in the ledger. Per record makes it additive: the base charge of any
group of rows (a day, a tenant, a period, a currency) is the sum of its
rows', so a daily export, a request export and ``burstgate margin`` agree to
the nano-unit, and ``user_charge = base_charge + dynamic_revenue`` exactly.
At multiplier 1 the base charge *is* the user charge. For a multiplier >= 1
it is within 1 nano-unit of recomputing the charge at multiplier 1 from the
prices in force at the time (the stored charge was itself rounded once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from controlplane.domain.money import CONTEXT, MULTIPLIER_DECIMALS, format_fixed, format_nanos

_MICRO: int = 10**MULTIPLIER_DECIMALS
_ONE_MICRO = _MICRO
_HUNDRED = Decimal(100)


def multiplier_micro(value: Any) -> int:
    """A stored multiplier (Decimal on PostgreSQL; a float-backed Decimal or
    text on SQLite) as integer millionths: multipliers have 6 decimals."""
    d = value if isinstance(value, Decimal) else Decimal(str(value))
    return int(CONTEXT.to_integral_value(CONTEXT.scaleb(d, MULTIPLIER_DECIMALS)))


def base_charge_nanos(user_charge_nanos: int, micro: int) -> int:
    """``user_charge / multiplier`` rounded half-to-even to the nano-unit,
    in integers (exact, and no Decimal per row). ``micro`` is the multiplier
    in millionths; a multiplier that is not positive (never stored: the step
    table refuses it) leaves the charge as it is."""
    if micro == _ONE_MICRO or micro <= 0:
        return user_charge_nanos
    sign = -1 if user_charge_nanos < 0 else 1
    q, r = divmod(abs(user_charge_nanos) * _MICRO, micro)
    if 2 * r > micro or (2 * r == micro and q % 2 == 1):
        q += 1
    return sign * q


@dataclass(slots=True)
class Sums:
    """Both ledgers summed over some rows, plus the base charge and what the
    multiplier-weighted mean needs. The first six fields are the ones SQL
    ``SUM()`` gives (``key``); the export checks its rows against them."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    user_charge_nanos: int = 0
    actual_cost_nanos: int = 0
    base_charge_nanos: int = 0
    # sum of multiplier (millionths) x base charge, and of the multipliers:
    # the base-charge-weighted mean, and the plain mean when nothing was charged
    weighted_micro: int = 0
    micro_sum: int = 0

    def add(self, prompt: int, cached: int, output: int, user: int, cost: int, micro: int) -> None:
        base = base_charge_nanos(user, micro)
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.output_tokens += output
        self.user_charge_nanos += user
        self.actual_cost_nanos += cost
        self.base_charge_nanos += base
        self.weighted_micro += micro * base
        self.micro_sum += micro

    def merge(self, other: Sums) -> None:
        for name in ("requests", "prompt_tokens", "cached_tokens", "output_tokens",
                     "user_charge_nanos", "actual_cost_nanos", "base_charge_nanos",
                     "weighted_micro", "micro_sum"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def key(self) -> tuple[int, ...]:
        return (
            self.requests, self.prompt_tokens, self.cached_tokens, self.output_tokens,
            self.user_charge_nanos, self.actual_cost_nanos,
        )  # fmt: skip

    # ------------------------------------------------------------- derived

    @property
    def tokens(self) -> int:
        """Prompt (cached included) plus output tokens."""
        return self.prompt_tokens + self.output_tokens

    @property
    def dynamic_revenue_nanos(self) -> int:
        return self.user_charge_nanos - self.base_charge_nanos

    @property
    def gross_margin_nanos(self) -> int:
        return self.user_charge_nanos - self.actual_cost_nanos

    def margin_percent(self) -> Decimal | None:
        """Gross margin / user charge x 100, 2 decimals (None: nothing charged)."""
        if self.user_charge_nanos == 0:
            return None
        ratio = CONTEXT.divide(Decimal(self.gross_margin_nanos), Decimal(self.user_charge_nanos))
        return CONTEXT.quantize(CONTEXT.multiply(ratio, _HUNDRED), Decimal("0.01"))

    def mean_multiplier(self) -> Decimal | None:
        """The multiplier weighted by base charge (the one that turns the base
        charge into the user charge, up to rounding); over rows charged
        nothing, the plain mean. None for no rows. 6 decimals, half-to-even."""
        if self.base_charge_nanos:
            num, den = self.weighted_micro, self.base_charge_nanos
        elif self.requests:
            num, den = self.micro_sum, self.requests
        else:
            return None
        mean = CONTEXT.divide(Decimal(num), Decimal(den * _MICRO))
        return Decimal(format_fixed(mean, MULTIPLIER_DECIMALS))

    def money_json(self) -> dict[str, Any]:
        """The amounts as the exports write them (9-decimal text)."""
        return {
            "user_charge": format_nanos(self.user_charge_nanos),
            "actual_cost": format_nanos(self.actual_cost_nanos),
            "base_charge": format_nanos(self.base_charge_nanos),
            "dynamic_revenue": format_nanos(self.dynamic_revenue_nanos),
        }

    def as_json(self, currency: str) -> dict[str, Any]:
        """A manifest's totals entry."""
        return {
            "currency": currency,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            **self.money_json(),
        }


class MicroCache:
    """Stored multiplier -> millionths; a ledger has few distinct ones."""

    def __init__(self) -> None:
        self._known: dict[Any, int] = {}

    def __call__(self, value: Any) -> int:
        micro = self._known.get(value)
        if micro is None:
            micro = multiplier_micro(value)
            if len(self._known) < 4096:
                self._known[value] = micro
        return micro


def add_record(sums: Sums, r: Sequence[Any], at: int, micro: MicroCache) -> None:
    """Add one record read as ``store.ledger_reads.SUM_COLUMNS`` (prompt, cached and output
    tokens, user charge and actual cost in nanos: BIGINT, so ints on both
    databases; the multiplier) from index ``at``."""
    sums.add(r[at], r[at + 1], r[at + 2], r[at + 3], r[at + 4], micro(r[at + 5]))
