"""Clients see only what a client of a sidecar sees: the retry rules of the
official openai Python client, and an admission plane told nothing a
sidecar could not tell it (no SLO, no first-arrival deadline)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_S
from controlplane.sim.engine import EngineParams, SimRequest
from controlplane.sim.harness import ClientKind, ClientModel, Job, Runner, estimate_capacity_rps
from controlplane.sim.policies import POOL, Burstgate, default_tenant_configs, tenant_rates
from controlplane.sim.trace import scale_to_rate
from tests.unit.sim.test_harness import LANES, synthetic

OPENAI = ClientModel(ClientKind.OPENAI)
SLO_AWARE = ClientModel(ClientKind.SLO_AWARE)
S = NS_PER_S


def job(attempts: int, *, slo_s: float = 1.0) -> Job:
    j = Job(SimRequest(7, 100, 10, 0), "premium", "premium", int(slo_s * S), retry_key="7")
    j.attempts = attempts
    return j


def delays(client: ClientModel, attempts: int, retry_after_s: float) -> set[int | None]:
    """The delays of 200 draws (jitter), or {None}: no retry."""
    rng = random.Random(1)
    return {
        client.retry_in_ns(job(attempts), int(retry_after_s * S), True, rng, 0) for _ in range(200)
    }


def test_openai_backs_off_exponentially_with_jitter_then_gives_up() -> None:
    # openai-python 2.54.0: min(0.5 s x 2^retries_taken, 8 s) x (1 - 0.25 x U[0, 1))
    first = delays(OPENAI, attempts=1, retry_after_s=0)
    assert all(d is not None and 0.375 * S < d <= 0.5 * S for d in first) and len(first) > 50
    second = delays(OPENAI, attempts=2, retry_after_s=0)
    assert all(d is not None and 0.75 * S < d <= 1.0 * S for d in second)
    # max_retries = 2: the third refusal is final
    assert delays(OPENAI, attempts=3, retry_after_s=0) == {None}


def test_openai_honours_retry_after_up_to_two_minutes_and_not_past_it() -> None:
    assert delays(OPENAI, attempts=1, retry_after_s=2.5) == {int(2.5 * S)}
    assert delays(OPENAI, attempts=2, retry_after_s=120) == {120 * S}
    assert delays(OPENAI, attempts=1, retry_after_s=121) == {None}  # 2.x: no retry at all


def test_openai_does_not_retry_what_the_plane_says_a_retry_cannot_help() -> None:
    rng = random.Random(0)
    assert OPENAI.retry_in_ns(job(1), 0, False, rng, 0) is None  # x-should-retry: false


def test_openai_does_not_know_its_slo_the_slo_aware_client_does() -> None:
    late = 5 * S  # long past the 1 s SLO of a request that arrived at 0
    rng = random.Random(0)
    assert OPENAI.retry_in_ns(job(1), int(0.2 * S), True, rng, late) == int(0.2 * S)
    assert SLO_AWARE.retry_in_ns(job(1), int(0.2 * S), True, rng, late) is None
    early = SLO_AWARE.retry_in_ns(job(1), int(0.2 * S), True, rng, 0)
    assert early is not None and int(0.2 * S) <= early < S
    assert ClientModel().retry_in_ns(job(1), 0, True, rng, 0) is None  # no retries


def test_the_plane_is_told_only_what_a_sidecar_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Admit: tenant, a fresh request id per attempt (<key>.<attempt>),
    lane "" (the tenant's default), prompt tokens, max_tokens, model "",
    the pool, the retry key and the attempt (0 first); no deadline or wait bound of the client's.
    With the pool gate off (no deadlines: its refusals may be retried), so
    the clients retry and the key is seen on every attempt."""
    trace = synthetic(500)
    params = EngineParams()
    scaled = scale_to_rate(trace, 1.5 * estimate_capacity_rps(trace, params))
    policy = Burstgate(
        default_tenant_configs(tenant_rates(scaled), LANES), policy=Policy(pool_gate=False)
    )
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    started = Burstgate.start

    def start(self: Burstgate, sim: Any, pool: Any) -> None:
        started(self, sim, pool)
        real = self.svc.admit_or_wait

        def recording(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(self.svc, "admit_or_wait", recording)

    monkeypatch.setattr(Burstgate, "start", start)
    res = Runner(scaled, policy, engines=1, params=params, client=OPENAI).run()
    assert len(calls) == sum(j.attempts for j in res.jobs)
    # no deadline_ns, no wait bound: only the retry key the sidecar derives
    # from the request, the same on every attempt
    assert all(set(kwargs) == {"retry_key", "attempt"} for _, kwargs in calls)
    by_row = {j.retry_key: j for j in res.jobs}
    for args, kwargs in calls:
        tenant, rid, lane, prompt, max_tokens, model, pool = args
        key, attempt = rid.rsplit(".", 1)
        assert (kwargs["retry_key"], kwargs["attempt"]) == (key, int(attempt) - 1)
        j = by_row[key]
        assert (tenant, lane, model, pool) == (j.tenant, "", "", POOL)
        assert (prompt, max_tokens) == (j.req.prompt, j.req.output)
        assert 1 <= int(attempt) <= j.attempts
    rids = [args[1] for args, _ in calls]
    assert len(set(rids)) == len(rids)  # every attempt is a new request id
    retried = [j for j in res.jobs if j.attempts > 1]
    assert retried and max(j.attempts for j in res.jobs) <= 3  # openai: 2 retries at most
