"""What the gate learns of a pool (service/pace.py): the pace of its
backlog's releases, and the first-token fit; and the bound on other lanes'
prefill per engine step that premium's SLO sets (PoolGate._step_tokens)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from controlplane.service.pace import TTFT_MIN_SAMPLES, PoolPace

from .conftest import LANES, UnitPolicy, tenant

MS = 1_000_000
S = 1_000 * MS


def test_the_pace_is_the_tokens_released_over_the_time_they_took() -> None:
    pace = PoolPace()
    assert pace.rate() is None
    pace.paced(0, 1_000)  # starts a stretch: nothing measured yet
    assert pace.rate() is None
    for i in range(1, 5):
        pace.paced(i * 100 * MS, 2_000)
    assert pace.rate() == pytest.approx(8_000 / 0.4)
    assert pace.wait_ns(20_000) == S


def test_idle_time_between_backlogs_is_not_pace() -> None:
    pace = PoolPace()
    pace.paced(0, 1_000)
    pace.paced(100 * MS, 1_000)  # 10,000 tokens/s
    pace.idle()  # the backlog emptied; an hour later another one
    pace.paced(3_600 * S, 1_000)
    pace.paced(3_600 * S + 100 * MS, 1_000)
    assert pace.rate() == pytest.approx(10_000)


def test_the_first_token_fit_recovers_the_engines_line() -> None:
    pace = PoolPace()
    rng = random.Random(1)
    for i in range(TTFT_MIN_SAMPLES - 1):
        pace.observe_ttft(1_000 + 100 * i, 50 * MS + (1_000 + 100 * i) * 40_000)
    assert pace.ttft_ns(1_000) is None  # not enough samples yet
    for _ in range(400):
        prompt = rng.randrange(10, 8_000)
        noise = rng.uniform(-5, 5) * MS
        pace.observe_ttft(prompt, int(50 * MS + prompt * 40_000 + noise))  # 40 us/token
    fit = pace.fit()
    assert fit is not None
    assert fit[0] == pytest.approx(0.050, abs=0.003)
    assert fit[1] == pytest.approx(40e-6, rel=0.03)
    assert pace.ttft_ns(5_000) == pytest.approx(250 * MS, rel=0.03)


def test_the_fit_follows_a_slower_engine() -> None:
    pace = PoolPace()
    for i in range(500):
        prompt = 500 + (i * 37) % 4_000
        pace.observe_ttft(prompt, 20 * MS + prompt * 20_000)
    for i in range(1_500):  # the engines slow down 4x (a bigger model, a longer context)
        prompt = 500 + (i * 37) % 4_000
        pace.observe_ttft(prompt, 20 * MS + prompt * 80_000)
    fit = pace.fit()
    assert fit is not None and fit[1] == pytest.approx(80e-6, rel=0.05)


def report(svc: Any, *, running: int = 0, batch: int = 0) -> None:
    svc.report_load("p", "e1", batch, 8192, 0, 0, None, 0.0,
                    requests_running=running, max_num_seqs=256)  # fmt: skip


def teach(svc: Any, clock: Any, us_per_token: int) -> None:
    """Premium requests of 1,000 tokens and their measured first tokens:
    a + b x prompt with a = 50 ms, b = us_per_token (a spread of sizes)."""
    for i in range(40):
        prompt = 500 + 25 * i
        report(svc)
        assert svc.admit("vip", f"t{i}", "", prompt, 1, pool="p").reason == 0
        first = clock() + 50 * MS + prompt * us_per_token * 1_000
        clock.advance(first - clock() + MS)
        svc.complete("vip", f"t{i}", 0, prompt, 1, first_token_ns=first)


@pytest.mark.parametrize(
    ("us_per_token", "starts"),
    [
        # 40 us/token: premium's 1 s less a report interval leaves room for
        # steps of far more than the 8,192-token budget: not bounded
        (40, 6),
        # 400 us/token: premium's 1 s less the report interval and 50 ms,
        # at 400 us a token, less its ~1,000-token prompt, over 2 steps: a
        # few hundred tokens a step, so one 1,000-token release at a time
        # (it starts with a partial chunk)
        (400, 1),
    ],
)
def test_a_slow_engine_takes_less_of_other_lanes_prefill_per_step(
    make_service: Any, clock: Any, us_per_token: int, starts: int
) -> None:
    vip = tenant("vip", default_lane="premium", burst_tokens=10**6)
    std = tenant(burst_tokens=10**6)
    svc = make_service(vip, std)
    svc.apply_config([vip, std], LANES, UnitPolicy())
    teach(svc, clock, us_per_token)
    clock.advance(100 * MS)
    report(svc, running=250)  # 6 free slots, 7,942 tokens of budget
    out = [svc.admit("acme", f"s{i}", "", 1_000, 10, pool="p").reason for i in range(8)]
    assert out.count(0) == starts


def test_without_first_tokens_the_pace_bounds_the_step_instead() -> None:
    """An engine's share of the pool's pace stands in for its prefill rate:
    the pool takes new work no faster than it prefills it."""
    from controlplane.service.gate import PoolGate
    from controlplane.service.pressure import load_sample

    def gate_after(pace_tokens_per_s: int) -> PoolGate:
        gate = PoolGate(stale_ns=10 * S)
        gate.configure(UnitPolicy(), ["premium"])
        for i in range(11):  # 1,000 tokens every 1,000,000 / pace ms
            gate.paced("p", i * 1_000 * S // pace_tokens_per_s, 1_000)
        now = 11 * 1_000 * S // pace_tokens_per_s
        for t in (now - 200 * MS, now - 100 * MS, now):  # reports every 100 ms
            gate.report(load_sample("p", "e1", 0, 8192, 0, 0, None, 0.0, t, 250, 256))
        assert gate._pools["p"].report_gap_ns == 100 * MS
        return gate

    def starts(gate: PoolGate) -> int:
        n = 0
        while gate.has_room("p", gate._pools["p"].engines["e1"].received_ns, 1_000, False):
            gate.released("p", gate._pools["p"].engines["e1"].received_ns, 1_000)
            n += 1
        return n

    # a fast pool: (pace x (1 s - the report gap) - 0) / 2 is past the budget
    assert starts(gate_after(100_000)) == 6  # the 6 free slots
    # a slow one: (2,000 tokens/s x 0.9 s - 0) / 2 = 900 tokens a step: one
    # release (it starts with a partial chunk), and at 10,000 tokens/s 4,500:
    # five (the fifth starts with what is left)
    assert starts(gate_after(2_000)) == 1
    assert starts(gate_after(10_000)) == 5
