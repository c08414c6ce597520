"""Backoff's three promises, as properties over any sequence of refusals:
never sooner than retry_after, never for a refusal that is not retryable,
never past the caller's deadline; and the jitter is full (0 up to the
exponential ceiling)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest
from burstgate_client.sdk import Admission, Backoff, FailPolicy
from burstgate_client.sdk.model import offline_admission
from hypothesis import given, settings
from hypothesis import strategies as st

REFUSED = dataclasses.replace(
    offline_admission("r", FailPolicy.CLOSED, 0, 1), offline=False, reason="token_rate"
)


def refusal(retry_after_ms: int, retryable: bool = True) -> Admission:
    return dataclasses.replace(REFUSED, retry_after_ms=retry_after_ms, retryable=retryable)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


refusals = st.lists(
    st.tuples(st.integers(0, 20_000), st.booleans()), min_size=1, max_size=40
)  # (retry_after_ms, retryable)
params = st.tuples(
    st.floats(0.001, 2.0), st.floats(1.0, 20.0), st.integers(0, 2**32)
)  # base_s, cap factor, seed


@settings(max_examples=300)
@given(refusals, params)
def test_never_sooner_than_retry_after(
    seq: list[tuple[int, bool]], p: tuple[float, float, int]
) -> None:
    base, factor, seed = p
    b = Backoff(base_s=base, cap_s=base * factor, rng=random.Random(seed))
    for retry_after_ms, retryable in seq:
        delay = b.next_delay(refusal(retry_after_ms, retryable))
        if delay is not None:
            assert delay >= retry_after_ms / 1000


@settings(max_examples=300)
@given(refusals, params)
def test_never_retries_what_is_not_retryable(
    seq: list[tuple[int, bool]], p: tuple[float, float, int]
) -> None:
    base, factor, seed = p
    b = Backoff(base_s=base, cap_s=base * factor, rng=random.Random(seed))
    for retry_after_ms, retryable in seq:
        delay = b.next_delay(refusal(retry_after_ms, retryable))
        if not retryable:
            assert delay is None


@settings(max_examples=300)
@given(refusals, params, st.floats(0.001, 60.0), st.lists(st.floats(0, 5.0), max_size=40))
def test_never_past_the_deadline(
    seq: list[tuple[int, bool]], p: tuple[float, float, int], deadline_s: float,
    elapsed: list[float],
) -> None:  # fmt: skip
    """Whatever time passes between attempts, a retry is only ever scheduled
    to start before the deadline."""
    base, factor, seed = p
    clock = FakeClock()
    b = Backoff(base_s=base, cap_s=base * factor, deadline_s=deadline_s,
                rng=random.Random(seed), clock=clock)  # fmt: skip
    deadline = clock.now + deadline_s
    for i, (retry_after_ms, _) in enumerate(seq):
        clock.now += elapsed[i] if i < len(elapsed) else 0.0
        delay = b.next_delay(refusal(retry_after_ms))
        if delay is not None:
            assert clock.now + delay < deadline
            clock.now += delay


@settings(max_examples=200)
@given(st.floats(0.001, 1.0), st.integers(1, 10), st.integers(0, 2**32))
def test_full_jitter_within_the_doubling_ceiling(base: float, factor: int, seed: int) -> None:
    cap = base * 2**factor
    b = Backoff(base_s=base, cap_s=cap, rng=random.Random(seed))
    for attempt in range(20):
        delay = b.next_delay(refusal(0))
        assert delay is not None
        assert 0 <= delay <= min(cap, base * 2**attempt)


def test_jitter_spreads_over_the_whole_range() -> None:
    # Full jitter, not "equal jitter": draws reach both ends of [0, ceiling].
    delays = []
    for seed in range(2000):
        b = Backoff(base_s=1.0, cap_s=1.0, rng=random.Random(seed))
        d = b.next_delay(refusal(0))
        assert d is not None
        delays.append(d)
    assert min(delays) < 0.01 and max(delays) > 0.99


def test_admitted_needs_no_retry() -> None:
    a = dataclasses.replace(REFUSED, admitted=True, reason="", retryable=False)
    assert Backoff().next_delay(a) is None


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"base_s": 0}, "base_s"), ({"cap_s": float("inf")}, "cap_s"),
     ({"base_s": 2.0, "cap_s": 1.0}, "cap_s"), ({"deadline_s": -1}, "deadline_s"),
     ({"base_s": float("nan")}, "base_s")],
)  # fmt: skip
def test_bad_settings_name_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        Backoff(**kw)


class ScriptedClient:
    """Answers admit() from a script; records the deadlines it was given."""

    deadline_s = 0.25

    def __init__(self, answers: list[Admission]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, float]] = []

    async def admit(self, tenant_id: str, request_id: str, **kw: float) -> Admission:
        self.calls.append((request_id, kw["deadline_s"]))
        return self.answers.pop(0)


def test_admit_retries_the_same_request_until_admitted() -> None:
    admitted = dataclasses.replace(REFUSED, admitted=True, reason="", retryable=False)
    client = ScriptedClient([refusal(1), refusal(2), admitted])
    b = Backoff(base_s=0.001, cap_s=0.002, rng=random.Random(1))
    got = asyncio.run(b.admit(client, "acme", "r1", prompt_tokens=1, max_tokens=1))  # type: ignore[arg-type]
    assert got.admitted and b.attempts == 2
    assert [c[0] for c in client.calls] == ["r1", "r1", "r1"]


def test_admit_gives_each_attempt_only_the_time_left() -> None:
    client = ScriptedClient([refusal(0, retryable=False)])
    b = Backoff(deadline_s=0.1)
    got = asyncio.run(b.admit(client, "acme", "r1", prompt_tokens=1, max_tokens=1))  # type: ignore[arg-type]
    assert not got.retryable
    assert client.calls[0][1] <= 0.1  # not the client's 0.25 s


class ScriptedSyncClient(ScriptedClient):
    def admit(self, tenant_id: str, request_id: str, **kw: float) -> Admission:  # type: ignore[override]
        self.calls.append((request_id, kw["deadline_s"]))
        return self.answers.pop(0)


def test_admit_sync_for_the_synchronous_client() -> None:
    admitted = dataclasses.replace(REFUSED, admitted=True, reason="", retryable=False)
    client = ScriptedSyncClient([refusal(1), admitted])
    b = Backoff(base_s=0.001, cap_s=0.002, deadline_s=5, rng=random.Random(1))
    got = b.admit_sync(client, "acme", "r1", prompt_tokens=1, max_tokens=1)  # type: ignore[arg-type]
    assert got.admitted and [c[0] for c in client.calls] == ["r1", "r1"]
