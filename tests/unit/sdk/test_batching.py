"""Micro-batching by default: a lone Admit is not held for the window,
concurrent ones share an AdmitBatch, a held batch goes when the batch in
flight is answered (asyncio's loop and uvloop's) or when an arrival finds it
older than the window; the window setting is validated; and the answers
built column by column are those built entry by entry."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy
from burstgate_client.sdk.aio import BATCH_WINDOW_S
from burstgate_client.sdk.answers import Answers
from burstgate_client.sdk.batcher import Batcher, wait_ms, wait_ms_column
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.model import (
    QUOTA_REASONS,
    REASON_NAMES,
    Admission,
    admissions_of_result,
)

ADMIT = pb.DECISION_ADMIT


class FakeCall:
    """An AdmitStream the test answers: ``written`` holds the batches sent;
    ``answer(k)`` admits every entry of the k-th."""

    def __init__(self) -> None:
        self.written: list[pb.AdmitBatch] = []
        self._results: asyncio.Queue[pb.AdmitBatchResult | None] = asyncio.Queue()
        self._ids = 0

    async def write(self, batch: pb.AdmitBatch) -> None:
        self.written.append(batch)

    def answer(self, k: int) -> None:
        b = self.written[k]
        n = len(b.request_id)
        self._results.put_nowait(pb.AdmitBatchResult(
            batch_id=b.batch_id, decision=[ADMIT] * n, granted_max_tokens=list(b.max_tokens),
            reservation_id=list(range(self._ids + 1, self._ids + n + 1)),
            bucket_remaining=[7] * n, hourly_remaining=[-1] * n, daily_remaining=[-1] * n,
            pricing_multiplier="1.000000",
        ))  # fmt: skip
        self._ids += n

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> pb.AdmitBatchResult:
        res = await self._results.get()
        if res is None:
            raise StopAsyncIteration
        return res

    def cancel(self) -> None:
        self._results.put_nowait(None)


class FakeStub:
    def __init__(self) -> None:
        self.call = FakeCall()

    def AdmitStream(self, metadata: Any = None) -> FakeCall:
        return self.call


class UpBreaker:
    up = True

    async def connect(self, budget: float) -> bool:
        return True

    def trip(self, why: str) -> None:
        raise AssertionError(f"tripped: {why}")

    def retry_hint_ms(self) -> int:
        return 0


def batcher(window_s: float, batch_max: int = 256) -> tuple[Batcher, FakeCall]:
    stub = FakeStub()
    b = Batcher(
        stub, None, UpBreaker(), Counters(), lambda lane: FailPolicy.CLOSED,  # type: ignore[arg-type]
        lambda e: None, window_s=window_s, batch_max=batch_max,
    )  # fmt: skip
    return b, stub.call


def entry(i: int, deadline: float) -> Entry:
    return Entry("acme", f"r{i}", "", 10, 5, "", "", deadline)


async def turns(n: int = 5) -> None:
    """Let the loop run ``n`` iterations (nothing here sleeps for real)."""
    for _ in range(n):
        await asyncio.sleep(0)


def on_both_loops(fn: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    def run(loop_kind: str) -> None:
        if loop_kind == "uvloop":
            uvloop = pytest.importorskip("uvloop")
            uvloop.run(fn())
        else:
            asyncio.run(fn())

    return run


LOOPS = pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])


@LOOPS
def test_a_lone_admit_is_sent_at_once_not_after_the_window(loop_kind: str) -> None:
    async def run() -> None:
        b, call = batcher(window_s=0.9)  # a window this long would be seen
        task = asyncio.ensure_future(b.admit(entry(0, b.now() + 60), 60))
        await turns()
        assert len(call.written) == 1 and list(call.written[0].request_id) == ["r0"]
        call.answer(0)
        a = await task
        assert a.admitted and a.request_id == "r0" and a.reservation_id == 1
        await b.aclose()

    on_both_loops(run)(loop_kind)


@LOOPS
def test_concurrent_admits_share_one_batch_and_keep_their_answers(loop_kind: str) -> None:
    async def run() -> None:
        b, call = batcher(window_s=0.9)
        tasks = [asyncio.ensure_future(b.admit(entry(i, b.now() + 60), 60)) for i in range(10)]
        await turns()
        assert len(call.written) == 1
        assert list(call.written[0].request_id) == [f"r{i}" for i in range(10)]
        call.answer(0)
        got = await asyncio.gather(*tasks)
        assert [a.request_id for a in got] == [f"r{i}" for i in range(10)]
        assert [a.reservation_id for a in got] == list(range(1, 11))
        await b.aclose()

    on_both_loops(run)(loop_kind)


@LOOPS
def test_a_held_batch_goes_when_the_batch_in_flight_is_answered(loop_kind: str) -> None:
    """Under uvloop as under asyncio's loop: the held batch must not wait
    for the window's timer once the batch in flight is answered."""

    async def run() -> None:
        b, call = batcher(window_s=0.9)
        first = asyncio.ensure_future(b.admit(entry(0, b.now() + 60), 60))
        await turns()
        held = [asyncio.ensure_future(b.admit(entry(i, b.now() + 60), 60)) for i in (1, 2)]
        await turns()
        assert len(call.written) == 1  # held: a batch is in flight
        call.answer(0)
        assert (await first).admitted
        await turns()
        assert len(call.written) == 2 and list(call.written[1].request_id) == ["r1", "r2"]
        call.answer(1)
        assert all(a.admitted for a in await asyncio.gather(*held))
        await b.aclose()

    on_both_loops(run)(loop_kind)


def test_an_arrival_past_the_window_sends_the_held_batch() -> None:
    """The loop's timer ticks in milliseconds: the window is kept by the
    next arrival (a fake clock here; nothing waits for real), which sends
    the held batch at the end of its loop iteration, with what else came."""

    async def run() -> None:
        b, call = batcher(window_s=0.5)
        first = asyncio.ensure_future(b.admit(entry(0, b.now() + 60), 60))
        await turns()
        assert len(call.written) == 1  # in flight, unanswered from here on
        loop = asyncio.get_running_loop()
        now = [loop.time()]

        def waited(i: int) -> Entry:
            e = entry(i, now[0] + 60)
            e.waiters.append(loop.create_future())  # a caller waits: it is sent
            return e

        loop.time = lambda: now[0]  # type: ignore[method-assign]
        b._enqueue(waited(1))
        b._enqueue(waited(2))
        held = b._flush_handle
        assert isinstance(held, asyncio.TimerHandle)  # waiting for the window
        now[0] += 0.5
        b._enqueue(waited(3))
        b._enqueue(waited(4))
        assert held.cancelled() and not isinstance(b._flush_handle, asyncio.TimerHandle)
        del loop.time
        await turns()
        assert len(call.written) == 2
        assert list(call.written[1].request_id) == ["r1", "r2", "r3", "r4"]
        first.cancel()
        await b.aclose()

    asyncio.run(run())


def test_a_zero_window_never_holds() -> None:
    async def run() -> None:
        b, call = batcher(window_s=0.0)
        first = asyncio.ensure_future(b.admit(entry(0, b.now() + 60), 60))
        await turns()
        second = asyncio.ensure_future(b.admit(entry(1, b.now() + 60), 60))
        await turns()
        assert len(call.written) == 2  # sent while the first is still unanswered
        call.answer(0)
        call.answer(1)
        assert (await first).admitted and (await second).admitted
        await b.aclose()

    asyncio.run(run())


def test_batch_max_flushes_before_the_window() -> None:
    async def run() -> None:
        b, call = batcher(window_s=0.9, batch_max=4)
        first = asyncio.ensure_future(b.admit(entry(0, b.now() + 60), 60))
        await turns()
        rest = [asyncio.ensure_future(b.admit(entry(i, b.now() + 60), 60)) for i in range(1, 5)]
        await turns()
        assert [len(w.request_id) for w in call.written] == [1, 4]
        call.answer(0)
        call.answer(1)
        await asyncio.gather(first, *rest)
        await b.aclose()

    asyncio.run(run())


def test_the_default_window_is_at_most_200_us() -> None:
    assert 0 < BATCH_WINDOW_S <= 0.0002


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-0.001, r"^batch_window_s: must be >= 0 and < 1 s \(0 = never hold\), got -0.001$"),
        (1.0, r"^batch_window_s: must be >= 0 and < 1 s"),
        (math.nan, r"^batch_window_s: must be >= 0 and < 1 s"),
        ("0.0002", r"^batch_window_s: must be a number of seconds, got str$"),
        (True, r"^batch_window_s: must be a number of seconds, got bool$"),
        (None, r"^batch_window_s: must be a number of seconds, got NoneType$"),
    ],
)
def test_a_bad_window_is_refused_naming_it(value: Any, message: str) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match=message):
            AsyncAdmissionClient("127.0.0.1:1", batch_window_s=value)

    asyncio.run(run())


def test_the_window_setting_reaches_the_batcher() -> None:
    async def run() -> None:
        c = AsyncAdmissionClient("127.0.0.1:1", batch_window_s=0.00005)
        assert c._batcher._window_s == 0.00005
        d = AsyncAdmissionClient("127.0.0.1:1")
        assert d._batcher._window_s == BATCH_WINDOW_S
        await c.aclose()
        await d.aclose()

    asyncio.run(run())


def test_the_wait_column_is_wait_ms_of_each() -> None:
    group = [entry(i, d) for i, d in enumerate([0.0, 0.004, 0.05, 0.25, 2.0, 100.0, 0.0051])]
    assert wait_ms_column(group, 0.0) == [wait_ms(e.deadline) for e in group]
    assert wait_ms_column(group, 1.0) == [wait_ms(e.deadline - 1.0) for e in group]


# ------------------------------------------------ answers, column by column


def reference(
    res: pb.AdmitBatchResult, columns: list[int], request_ids: list[str]
) -> list[Admission]:
    """Entry by entry, through Admission's own constructor."""
    n = len(res.decision)

    def col(c: Any, default: Any) -> list[Any]:
        out = list(c)
        return out + [default] * (n - len(out))

    g = res.degradation if res.HasField("degradation") and res.degradation.active else None
    out = []
    for k, rid in zip(columns, request_ids, strict=True):
        r = col(res.reason, 0)[k]
        name = REASON_NAMES.get(r) or ("" if not r else f"reason_{r}")
        d = g is not None and bool(col(res.degraded, 0)[k])
        fb = list(res.fallback_model)[k] if len(res.fallback_model) == n else (
            g.fallback_model if g is not None else "")  # fmt: skip
        out.append(Admission(
            rid, res.decision[k] == ADMIT, name, col(res.retry_after_ms, 0)[k],
            bool(col(res.retryable, 0)[k]), col(res.granted_max_tokens, 0)[k],
            col(res.reservation_id, 0)[k], d, g.max_tokens_cap if d and g else 0,
            fb if d else "", res.pricing_multiplier, col(res.bucket_remaining, 0)[k],
            col(res.hourly_remaining, -1)[k], col(res.daily_remaining, -1)[k],
            col(res.queue_wait_ms, 0)[k], False, name in QUOTA_REASONS,
            list(res.owner)[k] if len(res.owner) == n else "",
            list(res.admission_token)[k] if len(res.admission_token) == n else b"",
        ))  # fmt: skip
    return out


def random_result(rng: random.Random, n: int) -> pb.AdmitBatchResult:
    reasons = [0] * n if rng.random() < 0.3 else [rng.choice([0, 1, 2, 3, 99]) for _ in range(n)]

    def maybe(values: list[Any]) -> list[Any]:
        return values if rng.random() < 0.7 else values[: rng.randrange(n + 1)]

    res = pb.AdmitBatchResult(
        batch_id=1, decision=[rng.choice([ADMIT, pb.DECISION_REJECT]) for _ in range(n)],
        reason=maybe(reasons), retry_after_ms=maybe([rng.randrange(9) for _ in range(n)]),
        retryable=maybe([rng.random() < 0.5 for _ in range(n)]),
        granted_max_tokens=maybe([rng.randrange(99) for _ in range(n)]),
        reservation_id=maybe([rng.randrange(1, 9999) for _ in range(n)]),
        bucket_remaining=maybe([rng.randrange(-5, 99) for _ in range(n)]),
        hourly_remaining=maybe([rng.randrange(-1, 99) for _ in range(n)]),
        daily_remaining=maybe([rng.randrange(-1, 99) for _ in range(n)]),
        degraded=maybe([rng.random() < 0.5 for _ in range(n)]),
        queue_wait_ms=maybe([rng.randrange(50) for _ in range(n)]),
        pricing_multiplier=rng.choice(["", "1.000000", "1.250000"]),
    )  # fmt: skip
    if rng.random() < 0.5:
        res.degradation.CopyFrom(pb.Degradation(
            active=rng.random() < 0.8, max_tokens_cap=rng.randrange(1, 64), fallback_model="small",
        ))  # fmt: skip
    if rng.random() < 0.4:
        res.fallback_model.extend(rng.choice(["", "tiny", "mini"]) for _ in range(n))
    if rng.random() < 0.3:
        res.owner.extend(rng.choice(["", "cp-1:50051"]) for _ in range(n))
    if rng.random() < 0.3:
        res.admission_token.extend(bytes([rng.randrange(256)]) for _ in range(n))
    return res


def test_answers_built_by_column_equal_those_built_entry_by_entry() -> None:
    rng = random.Random(34)
    for _ in range(300):
        n = rng.randrange(1, 12)
        res = random_result(rng, n)
        if rng.random() < 0.5:
            columns = list(range(n))
        else:  # a release, or a first result with some entries queued
            columns = sorted(rng.sample(range(n), rng.randrange(n + 1)))
        ids = [f"r{k}" for k in columns]
        got = admissions_of_result(res, columns, ids)
        assert got == reference(res, columns, ids)
        assert all(type(a) is Admission for a in got)


def test_an_answer_built_by_column_is_a_frozen_admission() -> None:
    res = random_result(random.Random(1), 3)
    a = admissions_of_result(res, [0, 1, 2], ["a", "b", "c"])[1]
    assert isinstance(a, Admission) and a == dataclasses.replace(a)
    assert hash(a) == hash(dataclasses.replace(a))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.admitted = not a.admitted  # type: ignore[misc]
    assert repr(a).startswith("Admission(request_id='b', ")


def released_to(out: list[str]) -> Callable[[Entry], None]:
    return lambda e: out.append(e.request_id)


def test_settling_at_once_tells_each_caller_as_one_by_one() -> None:
    """Answers.settle_many (the stream's hot path) does what settle does for
    each entry: every waiting caller told, the entry forgotten, and a server
    admission that no caller was told of (the caller left) released."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        none, rate = pb.REASON_UNSPECIFIED, pb.REASON_TOKEN_RATE
        res = pb.AdmitBatchResult(
            batch_id=3,
            decision=[ADMIT, pb.DECISION_REJECT, ADMIT, ADMIT],
            reason=[none, rate, none, none],
        )
        answers = admissions_of_result(res, [0, 1, 2, 3], ["r0", "r1", "r2", "r3"])
        seen: dict[str, tuple[Any, ...]] = {}
        for way in ("one", "many"):
            released: list[str] = []
            counters = Counters()
            ans = Answers(
                loop, UpBreaker(), counters, lambda lane: FailPolicy.CLOSED,  # type: ignore[arg-type]
                released_to(released), lambda e: None,
            )  # fmt: skip
            group = [entry(i, 60.0) for i in range(4)]
            for e in group:
                ans.inflight[e.key] = e
                e.waiters.append(loop.create_future())
            group[2].waiters[0].cancel()  # that caller left: its admission is released
            group[3].waiters.append(loop.create_future())  # joined by a second caller
            if way == "one":
                for e, a in zip(group, answers, strict=True):
                    ans.settle(e, a)
            else:
                ans.settle_many(group, answers)
            results = [[w.result() for w in e.waiters if not w.cancelled()] for e in group]
            seen[way] = (results, released, counters.late_releases, dict(ans.inflight),
                         [(e.settled, e.told_admitted) for e in group])  # fmt: skip
            ans.close()
        assert seen["one"] == seen["many"]
        assert seen["many"][1] == ["r2"] and seen["many"][3] == {}

    asyncio.run(run())
