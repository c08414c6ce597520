"""Dynamic cost-aware pricing (SPEC section 4): pricing windows and the step
table. ``PricingBook`` is the admission path's ``Pricing``.

Windows are ``window_s`` long and aligned to the Unix epoch (UTC), so window
``k`` is ``[k*window_s, (k+1)*window_s)`` and its id is its start in Unix
seconds. Per pool and model a window measures the KV-cache miss rate:

- from completions that report their own ``kv_cache_miss_rate``, weighted
  by prompt tokens (the rate is a fraction of prefill work);
- from engine load reports (per pool, no model), a plain mean, used for a
  (pool, model) whose window had no reporting completion.

**The multiplier in force during window k comes from window k-1's measured
rate** through the step table. A client therefore sees one price for a whole
window, the price switches exactly at the boundary, and a window's price is
known before any of its traffic (nothing a request does can change the price
it is quoted). A window without any measurement leaves the base multiplier
(1) in force.

All of it runs on the event-loop thread; ``quote`` is a dict lookup and an
integer division while the window does not change.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from controlplane.domain.pricing import BASE_MULTIPLIER, StepTable, WindowSummary
from controlplane.domain.units import NS_PER_S, PPM
from controlplane.service.pricing import FLAT, PriceQuote


@dataclass(slots=True)
class _Acc:
    """One window's measurements for one (pool, model) (or pool-level load)."""

    completions: int = 0
    weight: int = 0  # sum of max(prompt_tokens, 1)
    weighted_ppm: int = 0  # sum of miss_ppm * weight
    loads: int = 0
    load_ppm: int = 0  # sum of reported miss ppm

    def completion_rate(self) -> int | None:
        return -(-self.weighted_ppm // self.weight) if self.weight else None

    def load_rate(self) -> int | None:
        return -(-self.load_ppm // self.loads) if self.loads else None


class _Series:
    """The current window of one (pool, model), with the previous window's
    measured rate."""

    __slots__ = ("acc", "index", "multiplier", "prev_rate")

    def __init__(self, index: int, prev_rate: int | None, multiplier: Decimal) -> None:
        self.index = index
        self.acc = _Acc()
        self.prev_rate = prev_rate
        self.multiplier = multiplier


class PricingBook:
    """Pricing windows per (pool, model) and the multiplier in force."""

    # Distinct (pool, model) pairs tracked; past this, new pairs get the flat
    # price (pool and model names come from clients).
    MAX_SERIES = 10_000

    def __init__(self, window_s: int, steps: StepTable) -> None:
        if window_s < 1:
            raise ValueError("pricing window must be at least 1 s")
        self.window_s = window_s
        self.window_ns = window_s * NS_PER_S
        self.steps = steps
        self._series: dict[tuple[str, str], _Series] = {}
        # pool -> load-report series (model "")
        self._loads: dict[str, _Series] = {}
        self._quotes: dict[tuple[str, str], tuple[int, PriceQuote]] = {}
        # Windows closed (or snapshotted) since the last flush, for the store.
        self.closed: list[WindowSummary] = []
        self.restored: dict[tuple[str, str, int], WindowSummary] = {}

    # ------------------------------------------------------------- windows

    def window_index(self, now_ns: int) -> int:
        return now_ns // self.window_ns

    def window_start_s(self, index: int) -> int:
        return index * self.window_s

    def _load_acc(self, pool: str, index: int) -> tuple[int, int, int | None]:
        """(reports, ppm sum, mean ppm) of the pool's load reports in window
        ``index`` (the load series keeps the previous window's mean)."""
        load = self._loads.get(pool)
        if load is not None:
            if load.index == index:
                return load.acc.loads, load.acc.load_ppm, load.acc.load_rate()
            if load.index == index + 1 and load.prev_rate is not None:
                return 0, 0, load.prev_rate
        return 0, 0, None

    def _measured(self, pool: str, s: _Series) -> int | None:
        rate = s.acc.completion_rate()
        if rate is None:
            rate = self._load_acc(pool, s.index)[2]
        return rate

    def _summary(self, pool: str, model: str, s: _Series, *, closed: bool) -> WindowSummary:
        rate = self._measured(pool, s)
        a = s.acc
        loads, load_ppm, _ = self._load_acc(pool, s.index)
        return WindowSummary(
            pool, model, self.window_start_s(s.index), self.window_s, a.completions, a.weight,
            a.weighted_ppm, loads, load_ppm, rate, s.multiplier,
            self.steps.multiplier(rate), closed,
        )  # fmt: skip

    def _series_for(self, pool: str, model: str, index: int) -> _Series | None:
        key = (pool, model)
        s = self._series.get(key)
        if s is None:
            if len(self._series) >= self.MAX_SERIES:
                return None
            s = self._new_series(pool, model, index)
            self._series[key] = s
        elif s.index < index:
            self._roll(pool, model, s, index)
        return s

    def _new_series(self, pool: str, model: str, index: int) -> _Series:
        start = self.window_start_s(index)
        prev = self.restored.pop((pool, model, start - self.window_s), None)
        # No stored previous window: the pool's load reports, if any.
        prev_rate = prev.miss_rate_ppm if prev is not None else self._load_acc(pool, index - 1)[2]
        s = _Series(index, prev_rate, self.steps.multiplier(prev_rate))
        cur = self.restored.pop((pool, model, start), None)
        if cur is not None:  # a restart inside this window: keep its measurements
            # (load reports of the window in progress are not restored)
            s.acc = _Acc(cur.completions, cur.completion_weight, cur.completion_weighted_ppm)
            s.multiplier = cur.multiplier
        return s

    def _roll(self, pool: str, model: str, s: _Series, index: int) -> None:
        summary = self._summary(pool, model, s, closed=True)
        self.closed.append(summary)
        if s.index == index - 1:
            s.prev_rate = summary.miss_rate_ppm
        else:  # no traffic of its own last window: the pool's load reports, if any
            s.prev_rate = self._load_acc(pool, index - 1)[2]
        s.index = index
        s.acc = _Acc()
        s.multiplier = self.steps.multiplier(s.prev_rate)

    # -------------------------------------------------------------- quotes

    def quote(self, pool: str, model: str, now_ns: int) -> PriceQuote:
        """The multiplier in force now for (pool, model); the decision path."""
        index = now_ns // self.window_ns
        key = (pool, model)
        cached = self._quotes.get(key)
        if cached is not None and cached[0] == index:
            return cached[1]
        s = self._series_for(pool, model, index)
        if s is None:
            return FLAT
        q = PriceQuote(float(s.multiplier), self.window_start_s(index))
        if len(self._quotes) >= self.MAX_SERIES:
            self._quotes.clear()
        self._quotes[key] = (index, q)
        return q

    def multiplier_decimal(self, value: float) -> Decimal:
        """The configured Decimal behind a quoted float multiplier."""
        from controlplane.domain.money import multiplier_decimal

        return self.steps.decimals.get(value) or multiplier_decimal(value)

    # -------------------------------------------------------- measurements

    def _load_series(self, pool: str, index: int) -> _Series:
        s = self._loads.get(pool)
        if s is None:
            s = _Series(index, None, BASE_MULTIPLIER)
            self._loads[pool] = s
        elif s.index < index:
            s.prev_rate = s.acc.load_rate() if s.index == index - 1 else None
            s.index = index
            s.acc = _Acc()
        return s

    def observe_completion(
        self, pool: str, model: str, prompt_tokens: int, miss_ppm: int, now_ns: int
    ) -> None:
        """A completion that reported its own cache-miss rate."""
        index = now_ns // self.window_ns
        s = self._series_for(pool, model, index)
        if s is None or s.index != index:
            return  # a late observation for a closed window is dropped
        w = max(prompt_tokens, 1)
        a = s.acc
        a.completions += 1
        a.weight += w
        a.weighted_ppm += miss_ppm * w

    def observe_load(self, pool: str, kv_cache_miss_rate: float, now_ns: int) -> None:
        """An engine load report of ``pool`` (ReportLoad)."""
        index = now_ns // self.window_ns
        if pool not in self._loads and len(self._loads) >= self.MAX_SERIES:
            return
        s = self._load_series(pool, index)
        if s.index != index:
            return
        s.acc.loads += 1
        s.acc.load_ppm += round(kv_cache_miss_rate * PPM)
        if (pool, "") not in self._series:
            self._series_for(pool, "", index)

    def current_rate_ppm(self, pool: str, model: str, now_ns: int) -> int | None:
        """The pool's current cache-miss rate for a completion that did not
        report one: this window's measurement so far, else the previous
        window's, else None."""
        index = now_ns // self.window_ns
        s = self._series_for(pool, model, index)
        if s is None:
            s = self._series.get((pool, ""))
            if s is None:
                return None
        rate = self._measured(pool, s) if s.index == index else None
        if rate is None:
            rate = self._load_acc(pool, index)[2]
        return rate if rate is not None else s.prev_rate

    # --------------------------------------------------------- persistence

    def snapshot(self, now_ns: int) -> list[WindowSummary]:
        """Closed windows since the last call (a series whose window has ended
        is closed now), plus the open windows as they stand (stored with
        closed=False so that a restart can continue them)."""
        index = now_ns // self.window_ns
        for (pool, model), s in list(self._series.items()):
            if s.index < index:
                self._roll(pool, model, s, index)
        out, self.closed = self.closed, []
        for (pool, model), s in self._series.items():
            out.append(self._summary(pool, model, s, closed=False))
        return out

    def restore(self, rows: Iterable[WindowSummary]) -> None:
        """Windows read back at start: the previous window sets the multiplier
        in force, the current one continues accumulating."""
        for r in rows:
            self.restored[(r.pool, r.model, r.window_start_s)] = r

    def drop_pools(self, pools: Iterable[str]) -> None:
        """Forget every window of ``pools`` (series, load reports, quotes,
        closed rows not yet stored, restored rows): this replica no longer
        owns them, or is about to reload them (``install``)."""
        gone = set(pools)
        if not gone:
            return
        for table in (self._series, self._quotes):
            for key in [k for k in table if k[0] in gone]:
                del table[key]
        for pool in gone:
            self._loads.pop(pool, None)
        self.closed = [w for w in self.closed if w.pool not in gone]
        for rkey in [k for k in self.restored if k[0] in gone]:
            del self.restored[rkey]

    def install(self, pools: Iterable[str], rows: Iterable[WindowSummary]) -> None:
        """Take ``pools`` over from stored windows (a cell's takeover): what
        this book held for them is dropped, and the stored rows continue as
        after a restart (the multiplier in force carries on). A pool with no
        stored rows (a cell nobody owned before) keeps what this book has
        measured since it was claimed: nothing else is there to continue."""
        wanted = set(pools)
        stored = [r for r in rows if r.pool in wanted]
        self.drop_pools({r.pool for r in stored})
        self.restore(stored)

    def in_force(self) -> list[tuple[str, str, Decimal, int | None]]:
        """(pool, model, multiplier, previous window's rate ppm) per series."""
        return [(p, m, s.multiplier, s.prev_rate) for (p, m), s in sorted(self._series.items())]
