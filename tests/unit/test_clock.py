from __future__ import annotations

import asyncio

import pytest

from controlplane.clock import ManualClock
from controlplane.domain.units import NS_PER_S


def test_manual_clock_wakes_due_sleepers_in_time_order() -> None:
    async def main() -> list[str]:
        clock = ManualClock(start_ns=0)
        woke: list[str] = []

        async def sleeper(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            woke.append(f"{name}@{clock() // NS_PER_S}")

        tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("b", 2), ("a", 1), ("c", 5))]
        await clock.settle()
        assert woke == [] and clock.sleepers == 3
        clock.advance(1.5)
        await clock.settle()
        assert woke == ["a@1"]
        clock.advance(10)  # both remaining are due; they run in the order of their times
        await clock.settle()
        await asyncio.gather(*tasks)
        return woke

    assert asyncio.run(main()) == ["a@1", "b@11", "c@11"]


def test_manual_clock_cancelled_sleep_and_no_going_back() -> None:
    async def main() -> None:
        clock = ManualClock(start_ns=5)
        task = asyncio.create_task(clock.sleep(1))
        await clock.settle()
        task.cancel()
        await clock.settle()
        clock.advance(2)  # the cancelled sleeper's future is skipped, not resolved twice
        assert task.cancelled()
        assert clock() == 5 + 2 * NS_PER_S
        with pytest.raises(ValueError, match="seconds"):
            clock.advance(-1)

    asyncio.run(main())
