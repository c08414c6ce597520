"""The price catalog and the two ledger formulas (SPEC section 3).

An entry is keyed by (tenant, model), where ``*`` means "any": a request is
priced by the most specific entry, in this order: (tenant, model),
(tenant, *), (*, model), (*, *). Token prices are per million tokens; the
GPU overhead is per request. Money is ``Decimal`` and every entry states its
currency (both ledgers of a record use it).

    input       = prompt_tokens - cached_tokens      (billed at the input price)
    user_charge = (input*p_in + cached*p_cached + output*p_out) / 1e6
                  x pricing_multiplier x lane_multiplier
    actual_cost = prompt*(1 + miss*0.5)*gpu_prefill / 1e6
                  + output*gpu_decode / 1e6 + gpu_overhead
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.money import (
    CONTEXT,
    MAX_MULTIPLIER,
    MAX_PRICE,
    MULTIPLIER_DECIMALS,
    PRICE_DECIMALS,
    TOKENS_PER_PRICE_UNIT,
    parse_decimal,
)

ANY = "*"
CURRENCY_RE = re.compile(r"^[A-Z]{3}$")  # ISO 4217 alphabetic code
HALF = Decimal("0.5")
ONE = Decimal(1)
PRICE_FIELDS = (
    "input_per_mtok",
    "cached_input_per_mtok",
    "output_per_mtok",
    "gpu_prefill_per_mtok",
    "gpu_decode_per_mtok",
    "gpu_overhead_per_request",
)


@dataclass(frozen=True, slots=True)
class PriceEntry:
    tenant_id: str  # "*" = every tenant without an entry of its own
    model: str  # "*" = any model
    currency: str
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    gpu_prefill_per_mtok: Decimal
    gpu_decode_per_mtok: Decimal
    gpu_overhead_per_request: Decimal
    # lane name -> multiplier of the user charge (e.g. premium 1.5); others 1.
    lane_multipliers: Mapping[str, Decimal] = field(default_factory=dict)
    id: int = 0  # the catalog row, recorded with each ledger row (0 = none)

    def lane_multiplier(self, lane: str) -> Decimal:
        return self.lane_multipliers.get(lane, ONE)

    def lane_multipliers_json(self) -> str:
        return json.dumps({k: str(v) for k, v in sorted(self.lane_multipliers.items())})


def zero_price(currency: str) -> PriceEntry:
    """What a request is priced at when the catalog has no entry for it:
    nothing, on both sides (and the record says price_id 0)."""
    z = Decimal(0)
    return PriceEntry(ANY, ANY, currency, z, z, z, z, z, z)


def validate_entry(e: PriceEntry) -> PriceEntry:
    """Check an entry; raise InvalidArgument naming the field."""
    from controlplane.domain.validate import check_id, check_optional_name

    check_id("tenant_id", e.tenant_id)
    check_optional_name("model", e.model)
    if not e.model:
        raise InvalidArgument("model", "must not be empty (use '*' for any model)")
    if not CURRENCY_RE.match(e.currency):
        raise InvalidArgument(
            "currency", f"must be an ISO 4217 code like USD, got {excerpt(e.currency)}"
        )
    for name in PRICE_FIELDS:
        parse_decimal(name, getattr(e, name), decimals=PRICE_DECIMALS, maximum=MAX_PRICE)
    for lane, m in e.lane_multipliers.items():
        check_id("lane_multipliers", lane, max_len=32)
        parse_decimal(
            f"lane_multipliers[{lane}]",
            m,
            decimals=MULTIPLIER_DECIMALS,
            maximum=MAX_MULTIPLIER,
            allow_equal_min=False,
        )
    return e


def parse_lane_multipliers(items: Iterable[str]) -> dict[str, Decimal]:
    """``["premium=1.5", "batch=0.8"]`` -> {lane: Decimal}."""
    out: dict[str, Decimal] = {}
    for item in items:
        lane, sep, value = item.partition("=")
        if not sep or not lane.strip():
            raise InvalidArgument(
                "lane_multipliers", f"expected LANE=MULTIPLIER, got {excerpt(item)}"
            )
        out[lane.strip()] = parse_decimal(
            f"lane_multipliers[{lane.strip()}]",
            value,
            decimals=MULTIPLIER_DECIMALS,
            maximum=MAX_MULTIPLIER,
            allow_equal_min=False,
        )
    return out


class PriceCatalog:
    """Entries in memory (read from the database off the request path);
    ``resolve`` is a dict lookup, memoised per (tenant, model)."""

    # Distinct (tenant, model) pairs memoised; past this the memo is reset.
    MEMO_LIMIT = 100_000

    def __init__(self, entries: Iterable[PriceEntry] = ()) -> None:
        self.entries: dict[tuple[str, str], PriceEntry] = {
            (e.tenant_id, e.model): e for e in entries
        }
        self._memo: dict[tuple[str, str], PriceEntry | None] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def resolve(self, tenant_id: str, model: str) -> PriceEntry | None:
        key = (tenant_id, model)
        try:
            return self._memo[key]
        except KeyError:
            pass
        e = self.entries
        found = e.get(key) or e.get((tenant_id, ANY)) or e.get((ANY, model)) or e.get((ANY, ANY))
        if len(self._memo) >= self.MEMO_LIMIT:
            self._memo.clear()
        self._memo[key] = found
        return found


def pricing_gaps(catalog: PriceCatalog, tenant_ids: Iterable[str]) -> list[str]:
    """What the catalog leaves unpriced, as findings for people (the
    start-up warning, ``burstgate config check``): no default ('*', '*')
    price, and the tenants with no price for every model (neither an entry
    (tenant, '*') nor the default). Empty when every request is priced."""
    if (ANY, ANY) in catalog.entries:
        return []
    out = ["the price catalog has no default price ('*', '*'): a (tenant, model) without "
           "an entry of its own is unpriced (booked at 0, or refused with "
           "BURSTGATE_LEDGER_UNPRICED=refuse); set one with `burstgate price set '*' "
           "--model '*' --input ... --output ...`"]  # fmt: skip
    bare = [t for t in tenant_ids if (t, ANY) not in catalog.entries]
    if bare:
        more = f" (+{len(bare) - 20} more)" if len(bare) > 20 else ""
        shown = ", ".join(sorted(bare)[:20]) + more
        models = sorted({m for (t, m) in catalog.entries if t == ANY and m != ANY})
        priced = f"; priced only for the models {', '.join(models[:10])}" if models else ""
        out.append(f"tenants without a price for every model: {shown}{priced}")
    return out


def user_charge(
    p: PriceEntry,
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    pricing_multiplier: Decimal,
    lane_multiplier: Decimal,
) -> Decimal:
    """The user ledger: cached prompt tokens at their own price, the rest of
    the prompt at the input price; x the multiplier locked at admission
    x the lane multiplier. Exact (no rounding here)."""
    c = CONTEXT
    uncached = prompt_tokens - cached_tokens
    tokens_value = c.add(
        c.add(
            c.multiply(Decimal(uncached), p.input_per_mtok),
            c.multiply(Decimal(cached_tokens), p.cached_input_per_mtok),
        ),
        c.multiply(Decimal(output_tokens), p.output_per_mtok),
    )
    per_unit = c.divide(tokens_value, TOKENS_PER_PRICE_UNIT)
    return c.multiply(c.multiply(per_unit, pricing_multiplier), lane_multiplier)


def actual_cost(
    p: PriceEntry, prompt_tokens: int, output_tokens: int, miss_rate: Decimal
) -> Decimal:
    """The cost ledger: prefill (dearer by half on cache misses), decode and a
    fixed overhead per request. Exact (no rounding here)."""
    c = CONTEXT
    prefill = c.multiply(
        c.multiply(Decimal(prompt_tokens), c.add(ONE, c.multiply(miss_rate, HALF))),
        p.gpu_prefill_per_mtok,
    )
    decode = c.multiply(Decimal(output_tokens), p.gpu_decode_per_mtok)
    return c.add(
        c.divide(c.add(prefill, decode), TOKENS_PER_PRICE_UNIT), p.gpu_overhead_per_request
    )
