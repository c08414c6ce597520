"""Deadlines (service/deadlines.py): a request is due at its first arrival
plus its asked lane's TTFT SLO, waits no longer than its latest release can
still meet it, is refused (flagged late, not retryable) when it cannot, and
its retries are judged against the first attempt's deadline."""

from __future__ import annotations

from typing import Any

from controlplane.domain import AdmitDecision, Decision
from controlplane.service.queueing import Waiter
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

MS = 1_000_000
GATE = UnitPolicy(gate_waiting_per_engine=2, gate_fallback_inflight=2)


def report(svc: Any, *, waiting: int = 0, running: int = 256, batch: int = 0) -> None:
    svc.report_load("p", "e1", batch, 8192, waiting, 0, None, 0.0,
                    requests_running=running, max_num_seqs=256)  # fmt: skip


def service(make_service: Any, *tenants: Any) -> Any:
    tenants = tenants or (tenant(), tenant("vip", default_lane="premium"))
    svc = make_service(*tenants)
    svc.apply_config(list(tenants), LANES, GATE)
    return svc


def held(svc: Any, tenant_id: str, rid: str, prompt: int = 10, max_tokens: int = 10,
         **kw: Any) -> tuple[Waiter, list[AdmitDecision]]:  # fmt: skip
    w = svc.admit_or_wait(tenant_id, rid, "", prompt, max_tokens, pool="p", **kw)
    assert isinstance(w, Waiter), w
    got: list[AdmitDecision] = []
    w.on_done = got.append
    return w, got


def teach_first_tokens(svc: Any, clock: Any, a_ms: int, us_per_token: int) -> None:
    """Complete 40 requests released now whose first tokens came
    a + b x prompt after release: the gate's first-token fit."""
    for i in range(40):
        prompt = 100 + 50 * i
        report(svc, waiting=0, running=0)
        assert svc.admit("vip", f"t{i}", "", prompt, 1, pool="p").decision == Decision.ADMIT
        first = clock() + a_ms * MS + prompt * us_per_token * 1000
        clock.advance(first - clock() + MS)
        svc.complete("vip", f"t{i}", 0, prompt, 1, first_token_ns=first)


def test_a_demoted_request_stays_due_when_its_own_lane_says(make_service: Any, clock: Any) -> None:
    # 20,000 tokens: placed in the batch lane (length-aware placement), but it
    # asked for standard: released by 3 s less the engine's headroom (2.25 s),
    # not by the batch lane's 11.25 s
    svc = service(make_service, tenant(burst_tokens=100_000))
    report(svc, waiting=5)
    w, got = held(svc, "acme", "long", 10_000, 10_000)
    assert w.lane == "batch"
    assert svc.next_wakeup_ns() == clock() + 2_250 * MS
    clock.advance(2_250 * MS)
    svc.tick()
    assert [(d.reason, d.retryable, d.lane) for d in got] == [
        (Reason.QUEUE_TIMEOUT, False, "batch")
    ]


def test_measured_first_tokens_set_the_latest_release(make_service: Any, clock: Any) -> None:
    svc = make_service(tenant("vip", default_lane="premium", burst_tokens=10**6),
                       tenant(burst_tokens=10**6))  # fmt: skip
    svc.apply_config([tenant("vip", default_lane="premium", burst_tokens=10**6),
                      tenant(burst_tokens=10**6)], LANES, UnitPolicy())  # fmt: skip
    report(svc, waiting=0, running=0)
    teach_first_tokens(svc, clock, a_ms=100, us_per_token=200)
    report(svc, waiting=5)  # full: the next one waits
    w, _ = held(svc, "acme", "held", 5_000, 10)
    # due in 3 s; its first token takes 100 ms + 5,000 x 200 us = 1.1 s
    assert abs(w.deadline_ns - (clock() + 1_900 * MS)) <= MS


def test_a_retry_is_judged_against_its_first_attempts_deadline(
    make_service: Any, clock: Any
) -> None:
    svc = service(make_service)
    report(svc, waiting=5)
    _, got = held(svc, "acme", "a.1", retry_key="req-a")
    clock.advance(2_250 * MS)
    svc.tick()
    assert [(d.reason, d.retryable) for d in got] == [(Reason.QUEUE_TIMEOUT, False)]
    # the client retries anyway, with a new request id and the same key: it
    # is past its latest release, refused at once, even with room now
    clock.advance(MS)
    report(svc, waiting=0, running=0)
    again = svc.admit_or_wait("acme", "a.2", "", 10, 10, pool="p", retry_key="req-a", attempt=1)
    assert isinstance(again, AdmitDecision)
    assert (again.reason, again.retryable) == (Reason.BACKPRESSURE, False)
    # another request (another key) is due 3 s after it arrives: admitted;
    # so is a first attempt under the same key (a new request with the same
    # body, as the sidecar keys them): only a retry says it is one
    for rid, key in (("b.1", "req-b"), ("a2.1", "req-a")):
        fresh = svc.admit_or_wait("acme", rid, "", 10, 10, pool="p", retry_key=key)
        assert isinstance(fresh, AdmitDecision) and fresh.decision == Decision.ADMIT


def test_a_retry_early_enough_waits_only_until_its_first_deadline(
    make_service: Any, clock: Any
) -> None:
    # refused at once by its full queue, then retried 1 s later: due 3 s after
    # the first attempt, it may wait 1.25 s more, not 2.25 s
    svc = make_service(tenant(max_queued=1))
    svc.apply_config([tenant(max_queued=1)], LANES, GATE)
    report(svc, waiting=5)
    held(svc, "acme", "first-waiter")
    full = svc.admit_or_wait("acme", "r.1", "", 10, 10, pool="p", retry_key="r")
    assert isinstance(full, AdmitDecision) and full.reason == Reason.QUEUE_FULL
    clock.advance(1_000 * MS)
    svc.cancel(svc._dispatcher.queues.by_key[("acme", "first-waiter")])
    w, _ = held(svc, "acme", "r.2", retry_key="r", attempt=1)
    assert w.deadline_ns == clock() + 1_250 * MS


def test_the_same_request_id_is_its_own_retry_key(make_service: Any, clock: Any) -> None:
    svc = service(make_service)
    report(svc, waiting=5)
    _, got = held(svc, "acme", "same")
    clock.advance(2_250 * MS)
    svc.tick()
    assert got[0].reason == Reason.QUEUE_TIMEOUT
    clock.advance(2_000 * MS)  # past the replay of its refusal
    report(svc, waiting=0, running=0)
    again = svc.admit_or_wait("acme", "same", "", 10, 10, pool="p")
    assert isinstance(again, AdmitDecision)
    assert (again.reason, again.retryable, again.duplicate) == (Reason.BACKPRESSURE, False, False)


def test_retry_memory_is_bounded_and_forgets_after_the_longest_slo(
    make_service: Any, clock: Any
) -> None:
    svc = make_service(tenant(), retry_memory=2)
    svc.apply_config([tenant()], LANES, GATE)
    memory = svc._deadlines.retries
    assert memory.ttl_ns == 15_000 * MS  # the batch lane's SLO, the longest
    for key in ("k1", "k2", "k3"):
        memory.refused(0, key, clock(), clock())
    assert len(memory) == 2 and memory.first(0, "k1", clock()) is None
    clock.advance(15_001 * MS)
    assert memory.first(0, "k3", clock()) is None and len(memory) == 0


def test_a_request_the_held_work_would_make_late_is_refused_at_arrival(
    make_service: Any, clock: Any
) -> None:
    svc = service(make_service, tenant(burst_tokens=10**7, max_queued=10_000),
                  tenant("vip", default_lane="premium"))  # fmt: skip
    report(svc, waiting=5)
    # a backlog of 40 x 1,000 tokens, released 4 per 100 ms: the pool's pace
    # is the 39,000 tokens released after the first over 0.9 s
    waiters = [held(svc, "acme", f"b{i}", 1_000, 10) for i in range(40)]
    for _ in range(10):
        clock.advance(100 * MS)
        report(svc, waiting=0, running=252)  # 4 free slots
    assert sum(w.done for w, _ in waiters) == 40
    report(svc, waiting=5)
    # standard: due in 3 s, released by 2.25 s (the engine's headroom): the
    # i-th new request waits behind i x 1,000 tokens, too long from i = 98
    # (98,000 / 43,333 tokens/s = 2.26 s)
    answers = [svc.admit_or_wait("acme", f"c{i}", "", 1_000, 10, pool="p") for i in range(102)]
    refused = [i for i, a in enumerate(answers) if isinstance(a, AdmitDecision)]
    assert refused == list(range(98, 102))
    late = answers[98]
    assert isinstance(late, AdmitDecision)
    assert (late.reason, late.retryable) == (Reason.BACKPRESSURE, False)
    # when a fresh request could go: its wait behind the held work plus the
    # engine's share (0.75 s), less the 3 s SLO
    wait = 98_000 * 900 * MS // 39_000
    assert abs(late.retry_after_ns - (wait + 750 * MS - 3_000 * MS)) <= MS
    # premium waits behind premium alone: held, not refused
    assert isinstance(svc.admit_or_wait("vip", "p", "", 1_000, 10, pool="p"), Waiter)


def test_a_refill_that_comes_too_late_is_not_retryable(make_service: Any, clock: Any) -> None:
    # an empty bucket refilling 1,000 tokens/s: 4,000 tokens come in 4 s, past
    # the standard lane's deadline; refused at once, and a retry cannot help
    svc = service(make_service, tenant(burst_tokens=5_000))
    report(svc, waiting=0, running=0)
    assert svc.admit("acme", "all", "", 5_000, 0, pool="p").decision == Decision.ADMIT
    d = svc.admit_or_wait("acme", "more", "", 4_000, 0, pool="p")
    assert isinstance(d, AdmitDecision)
    assert (d.reason, d.retryable) == (Reason.TOKEN_RATE, False)
    assert d.retry_after_ns == 4_000 * MS  # still the exact refill
    # with the gate off there are no deadlines: the same refusal may be retried
    off = make_service(tenant(burst_tokens=5_000), policy=UnitPolicy(pool_gate=False))
    off.admit("acme", "all", "", 5_000, 0)
    d = off.admit_or_wait("acme", "more", "", 4_000, 0)
    assert isinstance(d, AdmitDecision) and (d.reason, d.retryable) == (Reason.TOKEN_RATE, True)


def test_waiters_of_a_tenant_go_cheapest_first(make_service: Any, clock: Any) -> None:
    svc = service(make_service, tenant(burst_tokens=10**6))
    report(svc, waiting=5)
    order: list[str] = []
    for rid, prompt in (("big", 3_000), ("small", 100), ("mid", 1_000)):
        w, _ = held(svc, "acme", rid, prompt, 10)
        w.on_done = lambda d, rid=rid: order.append(rid)
    for _ in range(3):
        clock.advance(10 * MS)
        report(svc, waiting=0, running=255)  # one free slot each time
    assert order == ["small", "mid", "big"]


def test_premium_borrows_from_its_bucket_while_the_pool_has_room(make_service: Any) -> None:
    vip = tenant("vip", default_lane="premium", burst_tokens=1_000, token_rate=1)
    std = tenant("std", burst_tokens=1_000, token_rate=1)
    svc = make_service(vip, std)
    report(svc, waiting=0, running=0)
    assert svc.admit("vip", "a", "", 1_000, 0, pool="p").reason == Reason.OK  # level 0
    # past its rate while the pool has room: served, the bucket in debt
    assert svc.admit("vip", "b", "", 600, 0, pool="p").reason == Reason.OK
    assert svc.views.tenant_state("vip")["level_mtok"] == -600_000
    assert svc.admit("vip", "c", "", 600, 0, pool="p").reason == Reason.OK
    # charged in full (billing uses the usage), the level held at one burst of debt
    assert svc.views.record("vip", "c") is not None and svc.views.record("vip", "c").reserved == 600
    assert svc.views.tenant_state("vip")["level_mtok"] == -1_000_000
    # the other lanes do not borrow
    assert svc.admit("std", "a", "", 1_000, 0, pool="p").reason == Reason.OK
    assert svc.admit("std", "b", "", 600, 0, pool="p").reason == Reason.TOKEN_RATE


def test_premium_is_held_by_its_rate_when_the_pool_is_full(make_service: Any) -> None:
    """Where the rate matters: the gate holds premium with no room, and the
    refusal is the bucket's, as for anyone; with the gate off nobody borrows."""
    vip = tenant("vip", default_lane="premium", burst_tokens=1_000, token_rate=1)
    svc = make_service(vip)
    svc.apply_config([vip], LANES, GATE)
    report(svc, waiting=0, running=0)
    assert svc.admit("vip", "a", "", 1_000, 0, pool="p").reason == Reason.OK
    report(svc, waiting=5, running=256)  # the engines' queue is past its target
    assert svc.admit("vip", "b", "", 600, 0, pool="p").reason == Reason.BACKPRESSURE
    assert svc.views.tenant_state("vip")["level_mtok"] == 0  # nothing borrowed
    off = make_service(vip)
    off.apply_config([vip], LANES, GATE.model_copy(update={"pool_gate": False}))
    assert off.admit("vip", "a", "", 1_000, 0, pool="p").reason == Reason.OK
    assert off.admit("vip", "b", "", 600, 0, pool="p").reason == Reason.TOKEN_RATE


def test_premium_larger_than_its_bucket_runs_while_the_pool_has_room(
    make_service: Any,
) -> None:
    vip = tenant("vip", default_lane="premium", burst_tokens=1_000, token_rate=1,
                 hourly_quota=12_000)  # fmt: skip
    capped = tenant("capped", default_lane="premium", burst_tokens=1_000, token_rate=1,
                    max_tokens_per_request=1_500)  # fmt: skip
    svc = make_service(vip, capped)
    report(svc, waiting=0, running=0)
    # 5,000 tokens: more than the bucket takes (2 x 1,000); premium runs it,
    # leaving the bucket one burst in debt, and the next one too
    assert svc.admit("vip", "huge", "", 5_000, 0, pool="p").reason == Reason.OK
    assert svc.views.tenant_state("vip")["level_mtok"] == -1_000_000
    assert svc.admit("vip", "again", "", 5_000, 0, pool="p").reason == Reason.OK
    # a quota still binds, and a per-request cap the operator set still refuses
    assert svc.admit("vip", "third", "", 5_000, 0, pool="p").reason == Reason.MAX_TOKENS
    assert svc.admit("capped", "huge", "", 2_000, 0, pool="p").reason == Reason.MAX_TOKENS


def test_a_batch_flags_the_same_refusals_late_as_unary(make_service: Any) -> None:
    svc = service(make_service, tenant(burst_tokens=5_000))
    report(svc, waiting=0, running=0)
    r = svc.batches.admit(["acme"] * 2, ["all", "late"], [], [5_000, 4_000], [0, 0], pool="p")
    assert r.reason == [Reason.OK, Reason.TOKEN_RATE]
    assert r.retryable == [False, False]  # 4 s of refill is past the deadline
    r = svc.batches.admit(["acme"], ["soon"], [], [1], [0], pool="p")
    assert (r.reason, r.retryable) == ([Reason.TOKEN_RATE], [True])  # 1 ms is not
