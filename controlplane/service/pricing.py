"""The pricing seam of the admission path.

Every decision carries the pricing multiplier in force for its pool and
model, and the multiplier is *locked at admission*: the ledger bills what the
client was shown. The metering package supplies the real implementation
(pricing windows from cache-miss rates); ``FlatPricing`` is the one used
when no pricing is configured.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class PriceQuote(NamedTuple):
    multiplier: float  # applied to the user charge
    window_id: int  # the pricing window it came from (0 = none)


FLAT = PriceQuote(1.0, 0)


class Pricing(Protocol):
    def quote(self, pool: str, model: str, now_ns: int) -> PriceQuote:
        """The multiplier in force now; called on the decision path, so it
        must be a memory lookup."""
        ...

    def observe_load(self, pool: str, kv_cache_miss_rate: float, now_ns: int) -> None:
        """An engine's load report (its KV-cache miss rate feeds the pool's
        pricing window); a memory update."""
        ...


class FlatPricing:
    def quote(self, pool: str, model: str, now_ns: int) -> PriceQuote:
        return FLAT

    def observe_load(self, pool: str, kv_cache_miss_rate: float, now_ns: int) -> None:
        return None
