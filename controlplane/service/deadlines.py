"""Deadlines: when a request's first token is due, and whether it can still
be released in time.

With the pool gate on, every request of a lane that has a TTFT SLO
(``Policy.lane_ttft_slo_ms``) is **due** at its first arrival plus the SLO
of the lane it asked for. Length-aware placement may move it to a lower
lane (where it runs); it stays due when its own lane said. A retry of a
refused request, recognised by its retry key (service/retries.py), is due
when its first attempt was.

The **latest release** that can still meet the deadline is the due time
less the time a released request needs to get its first token: predicted
from the sidecars' measured first tokens (service/pace.py), else a share of
the SLO (``gate_release_headroom``). A request that would be released
later is refused rather than sent to an engine, where it would spend engine
time on work that has already missed:

- at arrival, when the work held ahead of it would take the pool past its
  latest release at the pool's measured pace (``hopeless``);
- while it waits, when its latest release passes (the dispatcher).

Such a refusal is **late**: its record carries ``records.LATE_BIT``, it is
answered ``retryable`` false (a retry of it cannot meet the same deadline),
and its ``retry_after`` says when a *fresh* request like it could be
released in time (``late_refusal``). Any other refusal of a request with a
deadline whose retry, after its ``retry_after``, would come past the latest
release is flagged late too (``late_if_past``). docs/gate.md has the
measurements behind these rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.domain.units import NS_PER_MS, NS_PER_S, PPM
from controlplane.service import records as R
from controlplane.service.answers import retryable
from controlplane.service.gate import MAX_RETRY_NS, MIN_RETRY_NS, PoolGate
from controlplane.service.pressure import PressureGate
from controlplane.service.queueing import WaitQueues
from controlplane.service.records import Record
from controlplane.service.retries import FirstArrivals
from controlplane.service.tenants import TenantDirectory


@dataclass(frozen=True, slots=True)
class BatchRetries:
    """The retries among a batch's entries (Deadlines.batch_retries)."""

    # entry -> retry_after: retries that can no longer meet their first
    # attempt's deadline, refused at arrival (when a fresh one could be)
    late: dict[int, int]
    # entry -> its first attempt's arrival: retries still in time, due then
    # plus their lane's SLO
    first: dict[int, int]


class Deadlines:
    def __init__(
        self,
        tenants: TenantDirectory,
        gate: PoolGate,
        pressure: PressureGate,
        queues: WaitQueues,
        retry_memory: int,
    ) -> None:
        self._tenants = tenants
        self._gate = gate
        self._pressure = pressure
        self._queues = queues
        # First arrivals of refused requests, for their retries; lifetime:
        # the longest lane SLO (set by ``configured``).
        self.retries = FirstArrivals(0, retry_memory)
        self._first_lanes: frozenset[int] = frozenset()  # fail-open lanes' indexes
        self._weights: list[int] = []  # per lane index, ppm

    def configured(self) -> None:
        """New lanes or policy (after the queues learnt the lanes)."""
        queues = self._queues
        lanes = self._tenants.by_priority
        self._first_lanes = frozenset(queues.lane_index(ln.name) for ln in lanes if ln.fail_open)
        self._weights = [0] * len(queues.per_lane)
        for lane in lanes:
            self._weights[queues.lane_index(lane.name)] = max(1, round(lane.weight * PPM))
        slos = self._tenants.policy.lane_ttft_slo_ms.values()
        self.retries.ttl_ns = max(slos, default=0) * NS_PER_MS

    # -------------------------------------------------------------- times

    def slo_ns(self, lane: str) -> int:
        """The TTFT SLO of requests that ask for ``lane``, with the pool gate
        on (0 = none: the gate is off, or the lane has no SLO)."""
        if not self._gate.enabled:
            return 0
        return self._tenants.policy.lane_ttft_slo_ms.get(lane, 0) * NS_PER_MS

    def engine_ns(self, slo: int, pool: str, prompt: int) -> int:
        """The time a request of ``prompt`` tokens needs after its release
        to get its first token: predicted from the pool's measured first
        tokens (service/pace.py); without them, ``gate_release_headroom`` of
        its SLO (the share kept for the engine)."""
        ttft = self._gate.ttft_ns(pool, prompt)
        if ttft is None:
            ttft = int(slo * self._tenants.policy.gate_release_headroom)
        return ttft

    def engine_ns_many(
        self, slo: int, pool: str, prompts: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """``engine_ns`` for many prompts of one pool (an AdmitStream batch)."""
        fit = self._gate.ttft_fit(pool)
        if fit is None:
            share = int(slo * self._tenants.policy.gate_release_headroom)
            return np.full(len(prompts), share, dtype=np.int64)
        a, b = fit
        return ((a + b * prompts) * NS_PER_S).astype(np.int64)

    def late_columns(
        self, pairs: list[tuple[str, str]], asked: npt.NDArray[np.intp],
        placed: npt.NDArray[np.intp], refused: npt.NDArray[np.bool_],
        retry_ns: npt.NDArray[np.int64], prompts: npt.NDArray[np.int64],
        waited: npt.NDArray[np.int64] | None = None,
    ) -> npt.NDArray[np.bool_]:  # fmt: skip
        """A batch's ``late_if_past``: which of its ``refused`` entries (a
        retryable refusal each, ``retry_ns`` after now) could not be
        released in time for their deadline when retried. ``pairs`` are the
        batch's (lane, pool) pairs; entry i asked for the lane of
        ``pairs[asked[i]]`` (its SLO applies) and goes to the pool of
        ``pairs[placed[i]]``. ``waited``: per entry, how long ago it first
        arrived (a retry judged against its first attempt, BatchRetries.first;
        None: every entry arrived now)."""
        late = np.zeros(len(refused), dtype=bool)
        if not self._gate.enabled:
            return late
        idx = np.flatnonzero(refused)
        for ka, kp in dict.fromkeys(zip(asked[idx].tolist(), placed[idx].tolist(), strict=True)):
            slo = self.slo_ns(pairs[ka][0])
            if not slo:
                continue
            mine = refused & (asked == ka) & (placed == kp)
            budget = slo - self.engine_ns_many(slo, pairs[kp][1], prompts[mine])
            if waited is not None:  # retries: due at their first arrival plus the SLO
                budget = budget - waited[mine]
            late[mine] = retry_ns[mine] > budget
        return late

    def release_by_ns(self, due: int, slo: int, pool: str, prompt: int) -> int:
        """The latest release that can still meet ``due``."""
        return due - self.engine_ns(slo, pool, prompt)

    def ahead_tokens(self, pool: str, lane_idx: int) -> int:
        """Prompt tokens held for ``pool`` that a new request of lane
        ``lane_idx`` would wait behind: every fail-open lane's (they go
        first), its own lane's, and of each other lane as much as the fair
        order releases while its own lane's go (their weights' ratio)."""
        tokens = self._queues.pool_tokens.get(pool)
        if tokens is None:
            return 0
        first = self._first_lanes
        if lane_idx in first:
            return sum(tokens[i] for i in first if i < len(tokens))
        own = tokens[lane_idx] if lane_idx < len(tokens) else 0
        weights = self._weights
        ahead = own
        for i, t in enumerate(tokens):
            if not t or i == lane_idx:
                continue
            if i in first:
                ahead += t
            else:
                ahead += min(t, own * weights[i] // max(1, weights[lane_idx]))
        return ahead

    def hopeless(self, pool: str, lane: str, now: int, release_by: int) -> bool:
        """A request that would wait behind the work held for ``pool`` now
        would be released after ``release_by`` (predicted from the pool's
        pace; never before the pace is known)."""
        if not release_by:
            return False
        ahead = self.ahead_tokens(pool, self._queues.lane_index(lane))
        wait = self._gate.wait_ns(pool, ahead) if ahead else 0
        return wait is not None and now + wait > release_by

    # ----------------------------------------------------------- refusals

    def late_refusal(
        self, reason: int, lane: str, slot: int, pool: str, prompt: int, slo: int, now: int,
        arrived: int,
    ) -> Record:  # fmt: skip
        """A refusal of a request that can no longer meet its deadline
        (flagged late: retrying it cannot help). ``retry_after`` says when a
        fresh request like it (its lane, where it runs; ``slo``, its SLO)
        could: when the held work ahead of one would be released in time."""
        retry = self.fresh_retry_ns(lane, pool, prompt, slo, now)
        v = self._pressure.verdict(lane, pool, now)
        return R.refused(reason, retry, lane, slot, now, arrived, score_ppm=v.score_ppm,
                         freshness=v.freshness, shed=R.SHED_BIT | R.LATE_BIT)  # fmt: skip

    def fresh_retry_ns(self, lane: str, pool: str, prompt: int, slo: int, now: int) -> int:
        """When a fresh request like this one (``lane``, where it runs;
        ``slo``, its SLO) could be released in time: when the held work
        ahead of one will have been released (the pool's pace), less the
        part of its SLO left for that wait; before a pace is measured, when
        the pool is predicted to take one more request (PoolGate.retry_ns)."""
        wait = self._gate.wait_ns(pool, self.ahead_tokens(pool, self._queues.lane_index(lane)))
        if wait is None:
            return self._gate.retry_ns(pool, now)
        retry = wait + self.engine_ns(slo, pool, prompt) - slo
        return min(max(retry, MIN_RETRY_NS), MAX_RETRY_NS)

    def late_if_past(
        self, rec: Record, due: int, slo: int, pool: str, prompt: int, now: int
    ) -> Record:
        """A refusal whose retry (after its retry_after) could no longer be
        released in time for ``due`` is flagged late: retrying cannot help.
        Admissions, refusals no wait cures and requests without a deadline
        are returned as they are."""
        if not due or rec[R.STATE] == R.OPEN or rec[R.SHED] & R.LATE_BIT:
            return rec
        if not retryable(rec[R.REASON]):
            return rec
        if now + rec[R.RETRY_NS] <= self.release_by_ns(due, slo, pool, prompt):
            return rec
        return (*rec[: R.SHED], rec[R.SHED] | R.LATE_BIT, *rec[R.SHED + 1 :])

    # ------------------------------------------------- batches (AdmitStream)

    def batch_retries(
        self, tenant_ids: list[str], request_ids: list[str], lanes: list[str],
        prompts: Sequence[int], max_tokens: Sequence[int], pool: str, keys: list[str],
        attempts: list[int], now: int,
    ) -> BatchRetries | None:  # fmt: skip
        """The entries of an AdmitStream batch answered at once that are
        retries of a refused request (None: none). As a unary Admit judges
        them: an entry is a retry when its attempt is > 0 or it has no retry
        key of its own (then its request id is its key). ``lanes`` has one
        entry per request ("" = the tenant's default); ``keys`` and
        ``attempts`` one per request, or none."""
        if not self._gate.enabled or not len(self.retries):
            return None  # nothing refused is remembered: no entry is a retry
        late: dict[int, int] = {}
        firsts: dict[int, int] = {}
        tenants = self._tenants
        for i, rid in enumerate(request_ids):
            key = keys[i] if keys else ""
            if key and attempts[i] <= 0:
                continue  # a first attempt under a key of its own
            entry = tenants.resolve(tenant_ids[i])
            if entry is None or not entry.config.enabled:
                continue  # refused for that, as any other entry
            asked = tenants.lane_for(f"lane[{i}]", lanes[i], entry)
            slo = self.slo_ns(asked)
            first = self.retries.first(entry.slot, key or rid, now) if slo else None
            if first is None:
                continue
            # where it goes (the screen above is the route's first steps,
            # cheap enough for every entry; the rest only for a retry)
            route = tenants.route(
                tenant_ids[i], lanes[i], prompts[i], max_tokens[i], pool, f"lane[{i}]"
            )
            lane, where = route.lane, route.pool
            if now > self.release_by_ns(first + slo, slo, where, prompts[i]):
                late[i] = self.fresh_retry_ns(lane, where, prompts[i], slo, now)
            else:
                firsts[i] = first
        return BatchRetries(late, firsts) if late or firsts else None

    def remember_refused(
        self, tenant_ids: list[str], request_ids: list[str], lanes: list[str], keys: list[str],
        attempts: list[int], reasons: Sequence[int], duplicate: Sequence[bool], now: int,
    ) -> None:  # fmt: skip
        """The refused entries of an AdmitStream batch answered at once, as
        a unary Admit remembers them: their retries are judged from now, or
        from their first attempt for a refused retry (keys and attempts as
        in :meth:`batch_retries`); a replayed answer changes nothing."""
        tenants = self._tenants
        # the refused entries found in one pass over the column, not in Python
        for i in np.flatnonzero(np.asarray(reasons)).tolist():
            if duplicate[i]:
                continue
            entry = tenants.resolve(tenant_ids[i])
            if entry is None or not entry.config.enabled:
                continue
            if not self.slo_ns(tenants.lane_for("lane", lanes[i], entry)):
                continue
            key = keys[i] if keys else ""
            retried = not key or attempts[i] > 0
            key = key or request_ids[i]
            first = self.retries.first(entry.slot, key, now) if retried else None
            self.retries.refused(entry.slot, key, now if first is None else first, now)
