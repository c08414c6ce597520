"""The simulation loop: a trace, a client model, an admission policy and a
pool of modelled engines, on one simulated clock.

Each trace request arrives at its (scaled) time and asks the policy. The
policy releases it to the pool at once, holds it and releases it later, or
refuses it; a policy may also abort a released request that the engine has
not started yet (``drop-late``). A released request goes to the engine with
the fewest outstanding tokens and waits in that engine's FIFO queue. What a
refused client does is its :class:`ClientModel`: give up, retry as the
official ``openai`` Python client does (the default retrying client: it
does not know its SLO), or retry only while its SLO can still be met (the
model burstgate was first measured with). Engines report their load every
``report_interval_s``, in vLLM's terms, to the policy.

With a prefix cache (``prefix_unit_tokens``; the trace's requests carry
block ids) each engine also reports its prefix-cache miss rate, measured
as a sidecar would from vLLM's counters (tokens looked up and found over
the last ``MISS_WINDOW_S``), and those reports feed the plane's own
pricing windows (``controlplane.ledger.pricing.PricingBook``): each request
is quoted the multiplier in force when it is released (its admission),
whatever the policy, as the plane would have priced it.

Everything is integer nanoseconds on one heap of events; with the same
inputs and seed a run is identical.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from controlplane.domain.units import NS_PER_S
from controlplane.ledger.pricing import PricingBook
from controlplane.sim.capacity import estimate_capacity_rps as estimate_capacity_rps
from controlplane.sim.engine import Engine, EngineParams, SimRequest
from controlplane.sim.pool import Pool
from controlplane.sim.prefixcache import MissMeter
from controlplane.sim.trace import TraceRequest

if TYPE_CHECKING:
    from controlplane.sim.scaling import ScalingLoop


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant of the simulation: its share of the trace's requests and
    its lane (whose TTFT SLO applies)."""

    name: str
    share: float
    lane: str


# The one pool the simulated engines serve (the plane's name for it).
POOL = "sim-pool"

# The measurement setup: three tenants, one per lane.
DEFAULT_TENANTS = (
    TenantSpec("premium", 0.20, "premium"),
    TenantSpec("standard", 0.50, "standard"),
    TenantSpec("batch", 0.30, "batch"),
)
# TTFT SLOs by lane, seconds (SPEC section 2 defaults).
DEFAULT_SLO_S = {"premium": 1.0, "standard": 3.0, "batch": 15.0}


# How a request ended: served by an engine, refused for good at the front
# door, or aborted at the engine before it started (drop-late).
SERVED, REFUSED, ABORTED = "served", "refused", "aborted"
OUTCOMES = (SERVED, REFUSED, ABORTED)


@dataclass(slots=True)
class Job:
    """One trace request on its way through the policy and the pool.

    ``slo_ns`` and ``deadline_ns`` are the measurement's, never the
    client's or the plane's: a real client does not send its SLO, so no
    policy adapter may pass them to the plane (drop-late, which models an
    engine-side timeout, is the one baseline that uses them)."""

    req: SimRequest
    tenant: str
    lane: str
    slo_ns: int
    # The client's own key for this request, the same on every attempt.
    # Each attempt is a new HTTP request with a new request id
    # (``attempt_id``), as the sidecar mints one per HTTP request; this is
    # kept so a policy adapter can pass it as a retry key once the
    # admission API has one (it has none today).
    retry_key: str = ""
    # The pricing multiplier quoted when it was released (its admission);
    # 1.0 without pricing windows.
    multiplier: float = 1.0
    attempts: int = 0  # arrivals at the front door, the first included
    outcome: str = ""  # SERVED | REFUSED | ABORTED | "" (still open)
    ended_ns: int = -1  # when it was served, refused for good or aborted
    reason: str = ""  # the final refusal's (or the abort's) reason
    refusals: int = 0  # refusals it got (retried or not)

    @property
    def deadline_ns(self) -> int:
        return self.req.arrival_ns + self.slo_ns

    @property
    def attempt_id(self) -> str:
        """The request id of the current attempt: ``<retry_key>.<attempt>``."""
        return f"{self.retry_key}.{self.attempts}"


class Simulation(Protocol):
    """What a policy may call back."""

    now: int

    def release(self, job: Job) -> None: ...

    def refuse(self, job: Job, reason: str, retry_after_ns: int, retryable: bool) -> None: ...

    def abort_unstarted(self, job: Job, reason: str) -> bool: ...


class AdmissionPolicy(Protocol):
    name: str

    def start(self, sim: Simulation, pool: Pool) -> None: ...

    def arrive(self, job: Job) -> None:
        """Decide: call ``sim.release`` or ``sim.refuse`` now, or later."""

    def completed(self, job: Job) -> None: ...

    def report(self, engine: Engine) -> None: ...

    def next_wakeup_ns(self) -> int | None: ...

    def tick(self) -> None: ...


@dataclass(slots=True)
class Sample:
    t_ns: int
    queue_depth: list[int]  # per engine: requests waiting
    running: list[int]
    kv_usage: list[float]
    engines: int = 0  # provisioned (starting, serving or draining)
    # Cumulative over every engine that ever served, at t_ns: prefix-cache
    # tokens looked up and found, prefill tokens computed, prefill step time (us).
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefill_tokens: int = 0
    prefill_us: float = 0.0


@dataclass
class SimResult:
    policy: str
    jobs: list[Job]
    samples: list[Sample]
    duration_ns: int
    engines: int
    preemptions: int
    capacity_rps: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    engine_seconds: float = 0.0  # engines provisioned x time, over the run
    engines_max: int = 0  # the most engines provisioned at once
    # What the autoscaler did (sim/scaling.py ScalingLoop.summary); empty: none ran.
    scaling: dict[str, Any] = field(default_factory=dict)
    # The prefix cache's tokens per block id (None: no cache) and the
    # pricing windows the engines' miss-rate reports fed (None: none).
    prefix_unit_tokens: int | None = None
    pricing: PricingBook | None = None


class ClientKind(StrEnum):
    NONE = "none"  # a refusal is final
    OPENAI = "openai"  # the official openai Python client's retries
    SLO_AWARE = "slo-aware"  # retries only while its SLO can still be met


@dataclass(frozen=True, slots=True)
class ClientModel:
    """What a refused client does.

    ``openai``: the official ``openai`` Python client as this project's
    lock pins it (2.54.0, ``openai/_base_client.py``): at most
    ``max_retries`` (2) retries; none when the answer says a retry cannot
    help (``retryable`` false: the sidecar's ``x-should-retry: false``);
    the delay is the answer's ``retry-after-ms`` when 0 < it <= 120 s
    (``MAX_RETRY_AFTER_DELAY``; 1.x clients used 60 s), no retry at all
    above that, else ``min(0.5 s x 2^retries_taken, 8 s) x (1 - 0.25 x
    U[0, 1))``. It does not know its SLO, so it comes back after it too.

    ``slo-aware``: ``max(retry_after, U(0, min(8 s, 0.5 s x 2^attempts)))``
    while that is before its SLO deadline; what burstgate's first figures
    were measured with (a client that knows its SLO: rarely true)."""

    kind: ClientKind = ClientKind.NONE
    max_retries: int = 2  # openai's DEFAULT_MAX_RETRIES
    backoff_base_s: float = 0.5  # openai's INITIAL_RETRY_DELAY
    backoff_cap_s: float = 8.0  # openai's MAX_RETRY_DELAY
    retry_after_max_s: float = 120.0  # openai's MAX_RETRY_AFTER_DELAY (2.x)

    def retry_in_ns(
        self, job: Job, retry_after_ns: int, retryable: bool, rng: random.Random, now_ns: int
    ) -> int | None:
        """Nanoseconds until the client tries again, or None: it gives up."""
        if self.kind == ClientKind.NONE or not retryable:
            return None
        if self.kind == ClientKind.SLO_AWARE:
            ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2**job.attempts)
            delay = max(retry_after_ns, int(rng.uniform(0, ceiling) * NS_PER_S), 1)
            return delay if now_ns + delay < job.deadline_ns else None
        taken = job.attempts - 1  # retries already made
        if taken >= self.max_retries:
            return None
        after_s = retry_after_ns / NS_PER_S
        if after_s > self.retry_after_max_s:
            return None  # openai 2.x will not wait that long, nor retry sooner
        if after_s > 0:
            return max(1, retry_after_ns)
        backoff = min(self.backoff_base_s * 2.0**taken, self.backoff_cap_s)
        return max(1, int(backoff * (1 - 0.25 * rng.random()) * NS_PER_S))


# Event kinds, in the order they run at the same instant: engine steps end
# first (they free capacity), then the policy's wake-ups and load reports,
# engines coming up and the autoscaler, then arrivals and retries.
_STEP, _WAKE, _REPORT, _READY, _SCALE, _ARRIVE, _RETRY = range(7)

# The window a sidecar measures an engine's prefix-cache miss rate over
# (the change of vLLM's query and hit counters across it).
MISS_WINDOW_S = 5.0


class Runner:
    def __init__(
        self,
        trace: list[TraceRequest],
        policy: AdmissionPolicy,
        *,
        engines: int,
        params: EngineParams,
        tenants: tuple[TenantSpec, ...] = DEFAULT_TENANTS,
        slo_s: dict[str, float] | None = None,
        client: ClientModel | None = None,
        report_interval_s: float = 0.1,
        sample_interval_s: float = 1.0,
        seed: int = 0,
        scaling: ScalingLoop | None = None,
        prefix_unit_tokens: int | None = None,
        pricing: PricingBook | None = None,
    ) -> None:
        """``prefix_unit_tokens``: model a prefix cache per engine, the
        trace's block ids being that many tokens each (None: none);
        ``pricing``: the plane's pricing windows, fed the engines' reported
        miss rates and quoted at each release."""
        self.now = 0
        # With an autoscaler the pool starts at its minimum, warm.
        self.scaling = scaling
        self.pool = Pool(
            scaling.params.min_engines if scaling else engines, params, prefix_unit_tokens
        )
        self.prefix_unit_tokens = prefix_unit_tokens
        self.pricing = pricing
        self._meters: dict[int, MissMeter] = {}
        self.policy = policy
        self.client = client or ClientModel()
        self.rng = random.Random(seed)
        slo = dict(DEFAULT_SLO_S) | (slo_s or {})
        lane_of = {t.name: t.lane for t in tenants}
        self.jobs: list[Job] = []
        for tr in trace:
            lane = lane_of.get(tr.tenant)
            if lane is None:
                raise ValueError(f"trace row {tr.row}: tenant {tr.tenant!r} is not configured")
            blocks = tr.blocks if prefix_unit_tokens is not None else ()
            req = SimRequest(tr.row, tr.prompt_tokens, tr.output_tokens, tr.t_ns, blocks)
            slo_ns = int(slo[lane] * NS_PER_S)
            self.jobs.append(Job(req, tr.tenant, lane, slo_ns, retry_key=str(tr.row)))
        self._heap: list[tuple[int, int, int, Any]] = []
        self._seq = itertools.count()
        self._report_ns = max(1, int(report_interval_s * NS_PER_S))
        self._sample_ns = max(1, int(sample_interval_s * NS_PER_S))
        self._wake_at: int | None = None
        self.samples: list[Sample] = []
        self._by_key = {j.req.key: j for j in self.jobs}
        self._open = len(self.jobs)  # requests not yet served or finally refused

    # -------------------------------------------------------- the policy's API

    def release(self, job: Job) -> None:
        if self.pricing is not None:  # the multiplier locked at admission
            job.multiplier = self.pricing.quote(POOL, "", self.now).multiplier
        engine = self.pool.route()
        engine.submit(job.req, self.now)
        if not engine.stepping:
            self._start(engine)

    def refuse(self, job: Job, reason: str, retry_after_ns: int, retryable: bool) -> None:
        job.refusals += 1
        delay = self.client.retry_in_ns(job, retry_after_ns, retryable, self.rng, self.now)
        if delay is not None:
            self._push(self.now + delay, _RETRY, job)
            return
        job.outcome = REFUSED
        job.reason = reason
        job.ended_ns = self.now
        self._open -= 1

    def abort_unstarted(self, job: Job, reason: str) -> bool:
        """Abort a released request its engine has not started (its client
        timed out, say); False, and nothing changes, once it has started."""
        req = job.req
        if req.engine < 0 or not self.pool.by_id[req.engine].cancel_waiting(req):
            return False
        job.outcome = ABORTED
        job.reason = reason
        job.ended_ns = self.now
        self._open -= 1
        return True

    # ------------------------------------------------------------------ loop

    def _push(self, t: int, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), payload))

    def _start(self, engine: Engine) -> None:
        end = engine.start_step(self.now)
        if end is not None:
            self._push(end, _STEP, engine)

    def _arm_wakeup(self) -> None:
        wake = self.policy.next_wakeup_ns()
        if wake is not None and (self._wake_at is None or wake < self._wake_at):
            self._wake_at = max(wake, self.now)
            self._push(self._wake_at, _WAKE, None)

    def run(self) -> SimResult:
        for job in self.jobs:
            self._push(job.req.arrival_ns, _ARRIVE, job)
        self.policy.start(self, self.pool)
        self._push(0, _REPORT, None)
        if self.scaling is not None:
            self._push(self.scaling.interval_ns, _SCALE, None)
        self._open = len(self.jobs)
        next_sample = 0
        while self._heap:
            t, kind, _, payload = heapq.heappop(self._heap)
            self.now = t
            while next_sample <= t:
                self._sample(next_sample)
                next_sample += self._sample_ns
            if kind == _STEP:
                engine: Engine = payload
                result = engine.finish_step(t)
                for req in result.finished:
                    job = self._by_key[req.key]
                    job.outcome = SERVED
                    job.ended_ns = t
                    self._open -= 1
                    self.policy.completed(job)
                if not engine.stepping:  # a completion may have released work to it
                    self._start(engine)
                if self.pool.draining and not engine.busy:
                    self.pool.retire_idle(t)
            elif kind in (_ARRIVE, _RETRY):
                job = payload
                job.attempts += 1
                self.policy.arrive(job)
            elif kind == _WAKE:
                if self._wake_at == t:
                    self._wake_at = None
                self.policy.tick()
            elif kind == _REPORT:
                for engine in self.pool.engines:
                    if engine.cache is not None:
                        self._measure_miss(engine, t)
                    self.policy.report(engine)
                if self.pricing is not None:
                    # What a plane with traffic does at every Admit: its
                    # windows roll, each recorded with the multiplier in force.
                    self.pricing.quote(POOL, "", t)
                if self._open > 0:  # reports stop with the last request
                    self._push(t + self._report_ns, _REPORT, None)
            elif kind == _READY:
                self.pool.ready(payload)
            elif kind == _SCALE:
                self._scale()
            self._arm_wakeup()
        self._sample(self.now)
        # The run ends with its last request, not with its last event: a
        # policy's timer left armed (a queue timeout, a deadline) must not
        # stretch the time goodput (and engine-seconds) are counted over.
        duration = max((j.ended_ns for j in self.jobs), default=self.now)
        return SimResult(
            policy=self.policy.name,
            jobs=self.jobs,
            samples=self.samples,
            duration_ns=duration,
            engines=self.scaling.params.max_engines if self.scaling else len(self.pool.engines),
            preemptions=sum(e.preemptions for e in self.pool.all_engines),
            engine_seconds=self.pool.engine_seconds(duration),
            engines_max=self.pool.engines_max,
            scaling=self.scaling.summary() if self.scaling else {},
            prefix_unit_tokens=self.prefix_unit_tokens,
            pricing=self.pricing,
        )

    def _measure_miss(self, engine: Engine, now: int) -> None:
        """The engine's windowed miss rate, as its sidecar reports it: kept
        on the engine for the policy's load report, and observed by the
        pricing windows."""
        c = engine.cache
        assert c is not None
        meter = self._meters.get(engine.engine_id)
        if meter is None:
            meter = self._meters[engine.engine_id] = MissMeter(int(MISS_WINDOW_S * NS_PER_S))
        rate = meter.rate(now, c.queries, c.hits)
        engine.miss_rate_reported = rate
        if rate is None:
            return
        if self.pricing is not None:
            self.pricing.observe_load(POOL, rate, now)

    def _scale(self) -> None:
        """One autoscaler evaluation: start or drain engines to its count."""
        assert self.scaling is not None
        pool, now = self.pool, self.now
        target = self.scaling.evaluate(now, pool)
        startup_ns = int(self.scaling.params.engine_startup_s * NS_PER_S)
        while pool.replicas < target:
            self._push(now + startup_ns, _READY, pool.start(now))
        while pool.replicas > target:
            before = pool.replicas
            pool.stop_one(now)
            if pool.replicas == before:
                break  # the last ready engine stays
        pool.retire_idle(now)
        if self._open > 0:
            self._push(now + self.scaling.interval_ns, _SCALE, None)

    def _sample(self, t: int) -> None:
        es = self.pool.engines
        waiting = [e.num_waiting for e in es]
        running = [e.num_running for e in es]
        kv = [round(e.kv_usage, 4) for e in es]
        sample = Sample(t, waiting, running, kv, self.pool.provisioned)
        if self.prefix_unit_tokens is not None:
            every = self.pool.all_engines
            sample.prefix_queries = sum(e.cache.queries for e in every if e.cache is not None)
            sample.prefix_hits = sum(e.cache.hits for e in every if e.cache is not None)
            sample.prefill_tokens = sum(e.prompt_tokens_total for e in every)
            sample.prefill_us = sum(e.prefill_us_total for e in every)
        self.samples.append(sample)
