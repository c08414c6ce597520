"""Answers from the wire, argument checks, the wait margin, stream-error
suspects, and a stream's bookkeeping of first results and releases."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk import FailPolicy
from burstgate_client.sdk.aio import fail_policies
from burstgate_client.sdk.batcher import wait_ms
from burstgate_client.sdk.checks import check_admit_args, check_complete_args
from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.model import (
    REASON_NAMES,
    Admission,
    admission_of_response,
    admissions_of_result,
    offline_admission,
)
from burstgate_client.sdk.session import Session
from burstgate_client.sdk.suspects import Suspects

ADMIT, REJECT, UNSET = pb.DECISION_ADMIT, pb.DECISION_REJECT, pb.DECISION_UNSPECIFIED
NONE, TIMEOUT = pb.REASON_UNSPECIFIED, pb.REASON_QUEUE_TIMEOUT


def test_reason_names_are_the_enum_without_prefix() -> None:
    assert REASON_NAMES[pb.REASON_UNSPECIFIED] == ""
    assert REASON_NAMES[pb.REASON_TOKEN_RATE] == "token_rate"
    assert REASON_NAMES[pb.REASON_OPEN_RESERVATIONS] == "open_reservations"
    assert len(REASON_NAMES) == len(pb.Reason.keys())


def test_unary_answer() -> None:
    resp = pb.AdmitResponse(
        request_id="r", decision=pb.DECISION_REJECT, reason=pb.REASON_DAILY_QUOTA,
        retry_after_ms=1200, retryable=True,
        remaining=pb.Remaining(bucket_tokens=5, hourly_tokens=-1, daily_tokens=0),
        queue_wait_ms=7, pricing_multiplier="1.200000",
    )  # fmt: skip
    a = admission_of_response(resp)
    assert (a.admitted, a.reason, a.retry_after_ms, a.retryable) == (
        False,
        "daily_quota",
        1200,
        True,
    )
    assert a.quota_exhausted and not a.offline and not a.degraded
    assert (a.bucket_remaining, a.hourly_remaining, a.daily_remaining) == (5, -1, 0)
    assert a.queue_wait_ms == 7 and a.pricing_multiplier == "1.200000"


def test_batch_columns_with_degradation_only_where_degraded() -> None:
    res = pb.AdmitBatchResult(
        batch_id=1, decision=[ADMIT, ADMIT], reason=[NONE, NONE], retry_after_ms=[0, 0],
        reserved_tokens=[10, 10],
        reservation_id=[11, 12], granted_max_tokens=[64, 5], bucket_remaining=[1, 2],
        hourly_remaining=[-1, -1], daily_remaining=[-1, -1], degraded=[False, True],
        degradation=pb.Degradation(active=True, max_tokens_cap=5, fallback_model="small"),
        pricing_multiplier="1.000000",
    )  # fmt: skip
    a0, a1 = admissions_of_result(res, [0, 1], ["r0", "r1"])
    assert a0.admitted and not a0.degraded and a0.max_tokens_cap == 0 and a0.fallback_model == ""
    assert a1.degraded and a1.max_tokens_cap == 5 and a1.fallback_model == "small"
    assert (a0.reservation_id, a1.granted_max_tokens) == (11, 5)
    assert not a0.retryable  # an empty column reads as its default


def test_offline_answers() -> None:
    o = offline_admission("r", FailPolicy.OPEN, 256, 40)
    assert o.admitted and o.offline and o.granted_max_tokens == 256 and o.reason == ""
    c = offline_admission("r", FailPolicy.CLOSED, 256, 40)
    assert not c.admitted and c.offline and c.reason == "unavailable"
    assert c.retryable and c.retry_after_ms == 40 and c.granted_max_tokens == 0


@pytest.mark.parametrize(
    ("remaining_s", "expected"),
    [(0.25, 225), (1.0, 900), (10.0, 9900), (0.03, 25), (0.004, 0), (0.0, 0), (-1.0, 0)],
)
def test_wait_ms_leaves_a_tenth_between_5_and_100_ms(remaining_s: float, expected: int) -> None:
    assert wait_ms(remaining_s) == expected


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tenant_id": ""}, "tenant_id: must not be empty"),
        ({"request_id": "x" * 129}, "request_id: longer than 128"),
        ({"prompt_tokens": -1}, "prompt_tokens: must be >= 0"),
        ({"max_tokens": 10_000_001}, "max_tokens: must be <= 10,000,000"),
        ({"max_tokens": 1.5}, "max_tokens: must be an int"),
        ({"lane": "l" * 33}, "lane: longer than 32"),
        ({"model": "bad\n"}, "model: must not contain control characters"),
        ({"pool": "p" * 129}, "pool: longer than 128"),
        ({"tenant_id": None}, "tenant_id: must be a str"),
    ],
)
def test_admit_arguments_name_the_field(kw: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"tenant_id": "acme", "request_id": "r", "prompt_tokens": 1,
                            "max_tokens": 1, "lane": "", "model": "", "pool": ""}  # fmt: skip
    args.update(kw)
    with pytest.raises(ValueError, match=f"^{message}"):
        check_admit_args(**args)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cached_prompt_tokens": 11}, "cached_prompt_tokens: 11 exceeds prompt_tokens 10"),
        ({"generated_tokens": -3}, "generated_tokens: must be >= 0"),
        ({"exec_start_unix_ns": 5, "exec_end_unix_ns": 4}, "exec_end_unix_ns: is before"),
        ({"exec_end_unix_ns": -1}, "exec_end_unix_ns: must be >= 0"),
        ({"kv_cache_miss_rate": 1.5}, "kv_cache_miss_rate: must be between 0 and 1"),
    ],
)
def test_complete_arguments_name_the_field(kw: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"tenant_id": "acme", "request_id": "r", "prompt_tokens": 10,
                            "generated_tokens": 1, "cached_prompt_tokens": 0,
                            "exec_start_unix_ns": 0, "exec_end_unix_ns": 0,
                            "kv_cache_miss_rate": None}  # fmt: skip
    args.update(kw)
    with pytest.raises(ValueError, match=f"^{message}"):
        check_complete_args(**args)


def test_fail_policies_per_lane_default_closed() -> None:
    assert fail_policies(FailPolicy.OPEN) == {"": FailPolicy.OPEN}
    got = fail_policies({"batch": "open"})  # type: ignore[dict-item]
    assert got == {"": FailPolicy.CLOSED, "batch": FailPolicy.OPEN}
    with pytest.raises(ValueError, match=r"^fail_policy: 'shut' for lane 'x'"):
        fail_policies({"x": "shut"})  # type: ignore[dict-item]


def entry(i: int, lane: str = "") -> Entry:
    return Entry("acme", f"r{i}", lane, 1, 1, "", "", 0.0)


def test_suspects_take_the_field_and_index_of_the_refused_batch() -> None:
    s = Suspects()
    batches = {7: [entry(0), entry(1, "gold")], 8: [entry(2, "silver")]}
    assert s.mark(batches, "batch 7: lane[1]: unknown lane 'gold'", 0.0) == ("lane", "gold")
    assert s(entry(5, "gold"), 1.0) and not s(entry(5, "silver"), 1.0)
    assert not s(entry(5, "gold"), 11.0)  # it expires
    assert s.mark(batches, "batch 9: lane[0]: ...", 0.0) is None  # not a batch we sent
    assert s.mark(batches, "prompt_tokens: ...", 0.0) is None


def test_session_first_result_then_releases() -> None:
    async def run() -> tuple[list[tuple[str, bool]], Session]:
        st = Session(call=None)
        group = [entry(i) for i in range(3)]
        st.batches[4] = group
        got: list[tuple[str, bool]] = []

        def settle(e: Entry, a: Admission) -> None:
            e.settled = True
            got.append((e.request_id, a.admitted))

        first = pb.AdmitBatchResult(
            batch_id=4,
            decision=[ADMIT, UNSET, UNSET],
            reason=[NONE] * 3,
            queued=[False, True, True],
        )
        assert st.dispatch(first, settle, 1.0) == 2
        assert group[1].queued and group[2].queued and 4 in st.batches
        st.dispatch(
            pb.AdmitBatchResult(batch_id=4, decision=[REJECT], reason=[TIMEOUT], entry=[2]),
            settle,
            2.0,
        )
        assert 4 in st.batches  # one release still owed
        st.dispatch(
            pb.AdmitBatchResult(batch_id=4, decision=[ADMIT], reason=[NONE], entry=[1]), settle, 3.0
        )
        return got, st

    got, st = asyncio.run(run())
    assert got == [("r0", True), ("r2", False), ("r1", True)]
    assert st.batches == {} and st.owed == {}


def test_session_end_returns_what_was_left_unanswered() -> None:
    st = Session(call=None)
    st.batches = {1: [entry(0)], 2: [entry(1)]}
    left = st.end(None)
    assert sorted(left) == [1, 2] and st.ended and st.batches == {}


def test_entry_tells_every_waiter_once() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        e = entry(0)
        e.waiters = [loop.create_future(), loop.create_future()]
        e.waiters[0].cancel()  # that caller left
        a = offline_admission("r0", FailPolicy.OPEN, 1, 1)
        e.tell(a)
        assert e.waiters[1].result() is a and e.told_admitted
        assert not e.live()

    asyncio.run(run())


def test_session_silence_counts_while_a_first_result_is_owed_and_nothing_is_read() -> None:
    st = Session(call=None)
    assert st.silence(5.0) == 0.0  # owes nothing
    st.batches = {1: [entry(0)], 2: [entry(1)]}
    st.unacked, st.sent_at = 2, deque([1.0, 1.5])
    assert st.silence(3.0) == 2.0  # since the oldest owed batch was sent
    first = pb.AdmitBatchResult(batch_id=1, decision=[ADMIT], reason=[NONE])
    st.last_read = 3.0
    st.dispatch(first, lambda e, a: None, 3.0)
    assert st.silence(3.25) == 0.25  # batch 2 still owed; something was read at 3.0
