"""The admission unary wrapper's counts and histograms: the same as one
``LatencyHistogram.observe`` per histogram and one count per call."""

from __future__ import annotations

import contextvars
import itertools
import time
from typing import Any

import pytest

from controlplane.rpc import calltiming
from controlplane.rpc.auth import admission_scope, rule_for
from controlplane.telemetry.grpc_metrics import RpcCollector, RpcStats
from controlplane.telemetry.histogram import LATENCY_BUCKETS_S, RPC_BUCKETS_S, LatencyHistogram

RULE = rule_for("/burstgate.v1.AdmissionService/Admit")
# one duration in (and at the edge of) every bucket of both histograms
DURATIONS = [b * f for b in RPC_BUCKETS_S for f in (0.5, 1.0, 1.5)] + [0.0, 1e6]


class Ctx:
    def __init__(self, code: Any = None) -> None:
        self._code = code

    def code(self) -> Any:
        return self._code


def drive(coro: Any) -> Any:
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("suspended")


def fake_clock(monkeypatch: pytest.MonkeyPatch, durations: list[float]) -> None:
    ticks = itertools.chain.from_iterable((0.0, d) for d in durations)
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))


def test_histograms_and_counts_match_one_observe_each(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_clock(monkeypatch, DURATIONS)
    stats = RpcStats()
    hist = stats.histogram("Admit")
    handling = stats.method(RULE.service, RULE.method, "unary")
    seen = []

    async def behavior(request: Any, context: Any) -> Any:
        seen.append(admission_scope.get())
        return request

    timed = calltiming.timed_unary(behavior, RULE, stats, hist, handling, None, 0.0)
    for i in range(len(DURATIONS)):
        assert drive(timed(i, Ctx())) == i
    ref_d, ref_h = LatencyHistogram(LATENCY_BUCKETS_S), LatencyHistogram(RPC_BUCKETS_S)
    for d in DURATIONS:
        ref_d.observe(d)
        ref_h.observe(d)
    assert hist.counts == ref_d.counts and hist.total == pytest.approx(ref_d.total)
    assert handling.counts == ref_h.counts and handling.total == pytest.approx(ref_h.total)
    started, handled = stats.counts()
    key = (RULE.service, RULE.method)
    assert started == {key: len(DURATIONS)}
    assert handled == {(*key, "OK"): len(DURATIONS)}
    assert seen == [None] * len(DURATIONS)


def test_failed_call_counted_with_its_code(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_clock(monkeypatch, [0.001, 0.002])
    stats = RpcStats()
    handling = stats.method(RULE.service, RULE.method, "unary")

    async def behavior(request: Any, context: Any) -> Any:
        if request:
            raise RuntimeError("boom")
        return request

    timed = calltiming.timed_unary(behavior, RULE, stats, None, handling, None, 0.0)
    drive(timed(0, Ctx()))
    with pytest.raises(RuntimeError):
        drive(timed(1, Ctx()))
    started, handled = stats.counts()
    key = (RULE.service, RULE.method)
    assert started == {key: 2}
    assert handled == {(*key, "OK"): 1, (*key, "UNKNOWN"): 1}
    assert sum(handling.counts) == 2
    families = {m.name: m for m in RpcCollector(stats).collect()}
    ok = [s for s in families["grpc_server_handled"].samples if s.labels.get("grpc_code") == "OK"]
    assert [s.value for s in ok] == [1]
    assert [s.value for s in families["grpc_server_started"].samples] == [2]


def test_scope_set_for_the_call() -> None:
    stats = RpcStats()
    handling = stats.method(RULE.service, RULE.method, "unary")
    scope: Any = object()

    async def behavior(request: Any, context: Any) -> Any:
        return admission_scope.get()

    timed = calltiming.timed_unary(behavior, RULE, stats, None, handling, scope, 0.0)
    # in a context of its own, as grpc runs each call in a task of its own
    assert contextvars.copy_context().run(drive, timed(0, Ctx())) is scope
    assert admission_scope.get() is None
