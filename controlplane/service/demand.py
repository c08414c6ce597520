"""Demand per pool: what users asked of it, for an autoscaler.

burstgate holds bursts in its own queues, so the engines' own queues
(vLLM's ``num_requests_waiting``) stay near zero through a burst and an
autoscaler reading them never scales out. What it should read instead is
what the plane sees (docs/autoscaling.md, "Signals"):

- **demand**: prompt tokens and requests per second asked of a pool, over
  the last ``DEMAND_WINDOW_S`` seconds (a sliding window of one-second
  buckets, the current partial second included, so there is neither lag
  nor bias). A request counts once, at its first decision, when it is
  admitted, held in burstgate's queues, or refused for *capacity*
  (``CAPACITY_REASONS``: the pool's backpressure or the gate, a full queue,
  a wait that ran out, the global in-flight watermark). A refusal for the
  tenant's own limits (bucket, quotas, concurrency, size, an unknown or
  disabled tenant, its open reservations) is not demand: more engines
  would not let it in. A retry the plane recognises as one (its first
  attempt was refused and remembered, service/retries.py) is not counted
  again: one user's ask is one request, however often the client retries.
  A request held only for its tenant's own limits counts when it is
  admitted from the queue.
- Tokens are **prompt tokens**, the unit of the work rate the pool gate
  learns (service/pace.py): prompt tokens the pool takes per second under
  its current load, decodes and KV cache included. So demand over work
  rate is engines, and a longer prompt at the same request rate asks for
  more engines (the "token density" axis).

Counting is O(1) per decision (an integer division, two list additions);
everything else is computed when asked (``AdmissionService.views.pool_demand``).
The forecast is the burst forecaster's Holt model with a damped trend
(controlplane/domain/holt.py, which analysis/forecast.py fits on logs; here
its fallback parameters), fed one value per completed second: the pool's
demand in prompt tokens that second.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.domain.holt import HOLT_DEFAULTS, HoltForecaster, HoltParams
from controlplane.domain.units import NS_PER_S
from fastpath import Reason

# Seconds of demand averaged. Short, so a burst shows within seconds; an
# autoscaler smooths further with its own stabilisation window.
DEMAND_WINDOW_S = 10
# Refusals that say the pool (or the plane as a whole) had no room: demand
# that more engines would have served. Every other refusal is the tenant's.
CAPACITY_REASONS = frozenset(
    {
        int(Reason.BACKPRESSURE),
        int(Reason.QUEUE_TIMEOUT),
        int(Reason.QUEUE_FULL),
        int(Reason.GLOBAL_WATERMARK),
    }
)
_OK = int(Reason.OK)
# Seconds of silence fed to the forecaster at most after a gap: enough for
# its level to decay to ~0 (alpha 0.1: 0.9^120 ~ 3e-6), bounded work.
MAX_FED_GAP_S = 120
# Seconds of demand desired_engines' demand term averages: longer than the
# metrics' window, because an autoscaler scales in only to the highest count
# of its stabilisation window (300 s in the recipes), so every noisy high of
# a short window is paid for five minutes. A burst does not wait for this
# average: held work raises desired_engines at once (its backlog term).
DESIRED_WINDOW_S = 60
_SLOTS = DESIRED_WINDOW_S + 1  # the longest window's seconds and the current one


# Seconds of history the per-engine work rate is measured over: long
# enough to hold a few runs of full engines, short enough to follow a
# change of traffic mix within minutes.
WORK_WINDOW_S = 600
# A second counts as gated (the engines the bottleneck) when work was held
# for the pool for at least this share of it, and the gate found no room
# for it at least once in that second.
GATED_SHARE = 0.9
# Gated seconds a measurement needs: one second's releases come in lumps
# (a report frees room, the gate fills it), so a rate from a couple of
# seconds is noise; with fewer in the window the last rate stands.
MIN_GATED_S = 10
# ... in runs of at least this many consecutive gated seconds: in a lone
# gated second or two (a burst's tail), the engines are busy with the work
# released just before and take little new work, so such seconds read low.
MIN_RUN_S = 5


class WorkRate:
    """Prompt tokens one engine of a pool takes per second when the pool is
    the bottleneck. A second counts when, in it, work was held for the pool
    for ``GATED_SHARE`` of the second or more, the gate found no room for
    it at least once (a held request tried again after a load report and
    held again for ``BACKPRESSURE``), and an engine reported requests
    waiting in its own queue; its measure is every prompt token released
    to the pool that second (straight away or from the backlog) over the
    engines reporting then. Such seconds count in runs of ``MIN_RUN_S`` or
    more in a row, and the rate is the best run's mean over the last
    ``WORK_WINDOW_S`` (once ``MIN_GATED_S`` seconds count in it).

    Why each condition (each removed a way the rate read low in
    ``burstgate simulate``): work stays held for a tenant's own limits (its
    bucket, its concurrency) while the engines have room; the gate holds a
    long prompt for a rule of its own while every engine's queue is empty;
    in the second or two after a burst the engines are busy with what was
    just released and take little new work. The best run, not the mean of
    all: whatever is left reads low, not high (the gate never releases
    more than the engines have room for). And why not the gate's pace
    (service/pace.py): it counts only the releases *from* the backlog, over
    a stretch's whole time, so when a backlog comes and goes (a pool near
    its capacity, where an autoscaler looks) the requests admitted straight
    away in between are missing from it and it reads far below what the
    engines take: the desired engine count doubled. What this measures is
    the rate the gate actually releases at per engine, at its own rules.

    O(1) per release and per report; ``rate`` is O(window)."""

    __slots__ = ("_denied", "_engines", "_full", "_gated", "_last", "_secs", "_since", "_tokens")

    def __init__(self) -> None:
        n = WORK_WINDOW_S + 1
        self._secs = [-1] * n
        self._tokens = [0] * n
        self._gated = [0] * n  # ns of the second with work held
        self._engines = [0] * n  # most engines reporting during the second
        self._denied = [False] * n  # the gate found no room in the second
        self._full = [False] * n  # an engine reported requests waiting in its own queue
        self._since = -1  # work held since (ns); -1: not held now
        self._last: float | None = None  # the last rate measured

    def _slot(self, sec: int) -> int:
        i = sec % len(self._secs)
        if self._secs[i] != sec:
            self._secs[i] = sec
            self._tokens[i] = self._gated[i] = self._engines[i] = 0
            self._denied[i] = self._full[i] = False
        return i

    def released(self, now: int, tokens: int) -> None:
        self._tokens[self._slot(now // NS_PER_S)] += tokens

    def engines(self, now: int, count: int, waiting: int = 0) -> None:
        """A load report at ``now``: ``count`` engines report, this one has
        ``waiting`` requests in its own queue."""
        i = self._slot(now // NS_PER_S)
        if count > self._engines[i]:
            self._engines[i] = count
        if waiting > 0:
            self._full[i] = True

    def held(self, now: int) -> None:
        """The gate found no room for held work (it stays held)."""
        if self._since < 0:
            self._since = now
        self._denied[self._slot(now // NS_PER_S)] = True

    def emptied(self, now: int) -> None:
        """Nothing is held for the pool any more."""
        if self._since >= 0:
            self._add_gated(self._since, now)
            self._since = -1

    def _add_gated(self, start: int, end: int) -> None:
        start = max(start, end - WORK_WINDOW_S * NS_PER_S)  # older seconds are gone
        while start < end:
            sec = start // NS_PER_S
            stop = min(end, (sec + 1) * NS_PER_S)
            self._gated[self._slot(sec)] += stop - start
            start = stop

    def rate(self, now: int) -> float | None:
        """Per-engine prompt tokens per second: the best run of the window's
        counted seconds (the current, partial one left out). A window with
        fewer than ``MIN_GATED_S`` of them keeps the last rate measured: a
        pool with room for its demand does not measure its engines again,
        and what they took when they were full still holds. None before a
        first measurement."""
        if self._since >= 0:  # the open interval so far counts
            self._add_gated(self._since, now)
            self._since = now
        sec = now // NS_PER_S
        need = GATED_SHARE * NS_PER_S
        size = len(self._secs)
        best = 0.0
        n = 0
        run: list[float] = []  # the current run of consecutive gated seconds
        for s in range(sec - WORK_WINDOW_S, sec + 1):  # oldest first; sec closes the last run
            i = s % size
            if (
                s < sec
                and self._secs[i] == s
                and self._gated[i] >= need
                and self._denied[i]
                and self._full[i]
                and self._engines[i]
            ):
                run.append(self._tokens[i] / self._engines[i])
                continue
            if len(run) >= MIN_RUN_S:
                best = max(best, sum(run) / len(run))
                n += len(run)
            run = []
        if n >= MIN_GATED_S:
            self._last = best
        return self._last


def counts_as_demand(reason: int) -> bool:
    """Whether a decision with ``reason`` is demand (admitted, or refused
    for capacity)."""
    return reason == _OK or reason in CAPACITY_REASONS


class DemandMeter:
    """One pool's demand: one-second buckets over the window, and the
    forecaster fed each completed second."""

    __slots__ = ("_fed", "_forecast", "_requests", "_secs", "_tokens")

    def __init__(self) -> None:
        self._secs = [-1] * _SLOTS  # the second each bucket holds
        self._tokens = [0] * _SLOTS
        self._requests = [0] * _SLOTS
        self._forecast = HoltForecaster(HoltParams(*HOLT_DEFAULTS))
        # Nothing was asked before the pool's first demand: the forecast
        # starts from 0, not from whatever its first second held.
        self._forecast.update(0.0)
        self._fed = -1  # the last second fed to the forecaster

    def add(self, now: int, tokens: int, requests: int = 1) -> None:
        """``requests`` requests of ``tokens`` prompt tokens in all were asked at ``now``."""
        sec = now // NS_PER_S
        i = sec % _SLOTS
        if self._secs[i] != sec:
            self._advance(sec)
            self._secs[i] = sec
            self._tokens[i] = 0
            self._requests[i] = 0
        self._tokens[i] += tokens
        self._requests[i] += requests

    def _advance(self, sec: int) -> None:
        """Feed the forecaster every second completed before ``sec``."""
        fed = self._fed
        if fed < 0:
            self._fed = sec - 1
            return
        if sec - 1 <= fed:
            return
        start = max(fed + 1, sec - MAX_FED_GAP_S)
        for s in range(start, sec):
            i = s % _SLOTS
            self._forecast.update(float(self._tokens[i]) if self._secs[i] == s else 0.0)
        self._fed = sec - 1

    def rates(self, now: int, window_s: int = DEMAND_WINDOW_S) -> tuple[float, float]:
        """(prompt tokens, requests) per second over the ``window_s``
        seconds (at most ``DESIRED_WINDOW_S``) ending now."""
        sec = now // NS_PER_S
        tokens = requests = 0
        for i, s in enumerate(self._secs):
            if sec - window_s <= s <= sec:
                tokens += self._tokens[i]
                requests += self._requests[i]
        span = (now - (sec - window_s) * NS_PER_S) / NS_PER_S
        return tokens / span, requests / span

    def forecast(self, now: int, horizon_s: float) -> float:
        """Prompt tokens per second expected ``horizon_s`` after now (the
        seconds completed so far fed first)."""
        self._advance(now // NS_PER_S)
        return self._forecast.forecast(max(1, round(horizon_s)))


class DemandBook:
    """Every pool's DemandMeter (made at a pool's first demand)."""

    __slots__ = ("meters",)

    def __init__(self) -> None:
        self.meters: dict[str, DemandMeter] = {}

    def add(self, pool: str, now: int, tokens: int, requests: int = 1) -> None:
        meter = self.meters.get(pool)
        if meter is None:
            meter = self.meters[pool] = DemandMeter()
        meter.add(now, tokens, requests)


@dataclass(frozen=True, slots=True)
class LaneBacklog:
    """One lane's work held for a pool."""

    lane: str
    requests: int  # held in burstgate's queues for the pool
    tokens: int  # their prompt tokens
    # How long a new request of this lane would wait before release: the
    # held work it waits behind (Deadlines.ahead_tokens) at the pool's work
    # rate; 0 with nothing ahead; None when work is held but the rate is not
    # known yet.
    predicted_wait_s: float | None


@dataclass(frozen=True, slots=True)
class PoolDemand:
    """What a pool is asked and what it needs (AdmissionService.views.pool_demand)."""

    pool: str
    engines_reporting: int  # engines with a fresh load report
    demand_tokens_per_s: float  # prompt tokens asked per second (DEMAND_WINDOW_S)
    demand_requests_per_s: float
    # Prompt tokens per second one engine takes under load: the pool gate's
    # pace (service/pace.py) over the engines reporting; None until the gate
    # has paced a backlog (or with no engine reporting).
    work_rate_per_engine: float | None
    desired_engines: int  # docs/autoscaling.md, "Signals"
    # The same at now + BURSTGATE_AUTOSCALE_ENGINE_STARTUP_S, from the
    # forecast demand alone (the backlog now is the reactive value's job).
    desired_engines_predicted: int
    forecast_tokens_per_s: float
    lanes: tuple[LaneBacklog, ...]

    @property
    def backlog_requests(self) -> int:
        return sum(b.requests for b in self.lanes)

    @property
    def backlog_tokens(self) -> int:
        return sum(b.tokens for b in self.lanes)
