"""Exact money: ``Decimal`` in, integer nano-units (1e-9 of the currency
unit) stored, fixed-format strings out.

Amounts are stored as integers so that ``SUM()`` is exact on PostgreSQL
(``numeric`` result) *and* on SQLite (64-bit integer arithmetic; a
floating ``NUMERIC`` there would not be). Every amount is rounded once, per
record, half-to-even, to 1e-9 of the currency unit.
"""

from __future__ import annotations

import functools
from decimal import ROUND_HALF_EVEN, Context, Decimal, InvalidOperation

from controlplane.domain.errors import InvalidArgument, excerpt

NANOS_PER_UNIT = 1_000_000_000
# Unit prices are quoted per million tokens (the industry's convention).
TOKENS_PER_PRICE_UNIT = Decimal(1_000_000)
# Enough digits for tokens (<= 1e7) x prices (<= 1e6, 9 decimals) x two
# multipliers (6 decimals each) without any intermediate rounding.
CONTEXT = Context(prec=80, rounding=ROUND_HALF_EVEN)
# Prices: at most 9 decimals and below a million per unit, so that SQLite
# (which keeps NUMERIC as a double) round-trips them exactly (15 digits).
PRICE_DECIMALS = 9
MAX_PRICE = Decimal(1_000_000)
MULTIPLIER_DECIMALS = 6
MAX_MULTIPLIER = Decimal(1000)
RATE_DECIMALS = 6  # cache-miss rates are kept in millionths


def to_nanos(amount: Decimal) -> int:
    """Round half-to-even to 1e-9 and return the integer nano-units."""
    return int(CONTEXT.to_integral_value(CONTEXT.scaleb(amount, 9)))


def format_nanos(nanos: int) -> str:
    """Fixed 9-decimal text (``-0.000000001``, ``12.500000000``): the only way
    amounts are written out, so exports are byte-identical."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANOS_PER_UNIT)
    return f"{sign}{whole}.{frac:09d}"


def format_fixed(value: Decimal, decimals: int) -> str:
    q = Decimal(1).scaleb(-decimals)
    return str(CONTEXT.quantize(value, q))


def parse_decimal(
    field: str,
    value: str | Decimal | int,
    *,
    decimals: int,
    maximum: Decimal,
    minimum: Decimal = Decimal(0),
    allow_equal_min: bool = True,
) -> Decimal:
    """A decimal from text, checked: finite, in range, at most ``decimals``
    decimal places. Raises InvalidArgument naming ``field``."""
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise InvalidArgument(field, f"not a decimal number: {excerpt(value)}") from None
    if not d.is_finite():
        raise InvalidArgument(field, f"must be finite, got {excerpt(value)}")
    if d < minimum or (not allow_equal_min and d == minimum):
        op = ">=" if allow_equal_min else ">"
        raise InvalidArgument(field, f"must be {op} {minimum}, got {d}")
    if d >= maximum:
        raise InvalidArgument(field, f"must be < {maximum}, got {d}")
    exponent = d.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -decimals:
        raise InvalidArgument(field, f"at most {decimals} decimal places, got {d}")
    return d


def multiplier_decimal(value: float) -> Decimal:
    """The Decimal a float multiplier came from. Multipliers are configured as
    decimals with <= 6 places, and ``repr`` of a float is the shortest text
    that round-trips, so this gives the configured value back exactly."""
    return CONTEXT.quantize(Decimal(repr(value)), Decimal(1).scaleb(-MULTIPLIER_DECIMALS))


@functools.lru_cache(maxsize=1024)
def format_multiplier(value: float) -> str:
    """A float multiplier as the API writes it: 6-decimal text ("1.200000"),
    the ledger's form. Cached: it is on every Admit answer, and a pool's
    multiplier takes few distinct values."""
    return format_fixed(multiplier_decimal(value), MULTIPLIER_DECIMALS)


def rate_ppm(rate: float) -> int:
    """A 0..1 rate as integer millionths (half-to-even)."""
    return int(CONTEXT.to_integral_value(CONTEXT.scaleb(Decimal(repr(rate)), 6)))


def ppm_decimal(ppm: int) -> Decimal:
    return Decimal(ppm).scaleb(-RATE_DECIMALS)
