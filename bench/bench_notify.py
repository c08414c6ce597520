"""How fast a change reaches a running server with LISTEN/NOTIFY, against
the config poll alone; and how fast a released cell is taken (issue 16:
"config change visible on all replicas <= 1 s p99", "graceful handoff
<= 1 s").

    .venv/bin/python bench/bench_notify.py [--n 200] [--poll-n 10] [--rounds 10]

Needs PostgreSQL (BURSTGATE_TEST_PG_DSN, default the local test server);
makes a database of its own and drops it. One process:

* **config**: a ControlPlane on a uvloop thread, config poll 30 s (then the
  default 2 s), LISTEN on. The bench thread changes a tenant's rate with
  ``ConfigRepository.update_tenant`` (what ``burstgate tenant update``
  runs), then waits, reading ``config_reloads`` every 0.2 ms, until the
  server has applied it (checked on its loop); the delay is from the
  commit's return to the apply. One change at a time. A second, bare
  ``Listener`` (a stand-in for a second replica, which the one-replica
  guard does not allow yet) records when each notification reaches it.
* **poll only**: the same with ``listen_notify`` off and the default 2 s poll.
* **handoff**: two coordinators, TTL 5 s (tick 1.67 s): A holds 8 cells and
  drains (SIGTERM); the time until B owns them all, with B woken by the
  release's NOTIFY, and without (B's own tick).

Nothing here asserts a time; the figures go to docs/ha.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from decimal import Decimal
from typing import Any, TypeVar

from _pg import database
from sqlalchemy import Engine

from controlplane.domain import TenantConfig
from controlplane.ha.coordinator import Coordinator
from controlplane.server import ControlPlane
from controlplane.settings import Settings
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.leases import HaStore
from controlplane.store.notify import CONFIG_CHANNEL, LEASES_CHANNEL, Listener
from controlplane.telemetry import logs

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def call(self, fn: Callable[[], T]) -> T:
        fut: Future[T] = Future()
        self.loop.call_soon_threadsafe(lambda: fut.set_result(fn()))
        return fut.result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def line(what: str, xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return (f"{what:<44} n={len(ms):>4}  p50 {pct(ms, 50):8.1f} ms  p99 {pct(ms, 99):8.1f} ms"
            f"  max {max(ms):8.1f} ms")  # fmt: skip


async def make_plane(url: str, **overrides: Any) -> ControlPlane:
    settings = Settings(database_url=url, host="127.0.0.1", port=0, metrics_port=-1,
                        admission_auth=False, **overrides)  # fmt: skip
    plane = ControlPlane(settings)
    await plane.start()
    return plane


def config_delays(
    url: str, n: int, gap_s: float, **overrides: Any
) -> tuple[list[float], list[float]]:
    """(apply delays at the server, delivery delays at a bare listener); each
    change is made a random 0..gap_s after the last one was applied (with the
    poll alone, so that it lands anywhere in the poll's period)."""
    lt = LoopThread()
    plane: ControlPlane = lt.run(make_plane(url, **overrides))
    heard: dict[str, float] = {}
    bare = Listener(url)

    def hear(payload: str | None) -> None:
        if payload is not None:
            heard.setdefault(payload, time.perf_counter())

    bare.on(CONFIG_CHANNEL, hear)
    lt.call(bare.start)
    while not bare.connected or (plane.listener is not None and not plane.listener.connected):
        time.sleep(0.01)
    time.sleep(0.2)  # the resyncs of the first connects are done
    engine = make_engine(url)
    repo = ConfigRepository(engine)
    applied: list[float] = []
    delivered: list[float] = []
    try:
        for i in range(n):
            rate = Decimal(1000 + i)
            before = plane.config_reloads
            repo.update_tenant("acme", {"token_rate": rate})
            t_commit = t_seen = time.perf_counter()
            while True:
                if plane.config_reloads != before:
                    t_seen = time.perf_counter()
                    limits = lt.call(lambda: plane.service.views.tenant_limits("acme"))
                    if limits.token_rate == rate:
                        break
                    before = plane.config_reloads
                time.sleep(0.0002)
            applied.append(t_seen - t_commit)
            key = "tenant.update tenant:acme"
            deadline = time.perf_counter() + 5
            while key not in heard and time.perf_counter() < deadline:
                time.sleep(0.0002)
            if key in heard:
                delivered.append(max(0.0, heard.pop(key) - t_commit))
            time.sleep(random.uniform(0, gap_s))
    finally:
        engine.dispose()
        lt.run(bare.stop())
        lt.run(plane.stop(0))
        lt.close()
    return applied, delivered


async def handoff_once(engine: Engine, url: str, r: int, wake: bool) -> float:
    cells = [f"r{r}-cell-{i}" for i in range(8)]
    a = Coordinator(HaStore(engine), f"a{r}", "a:1", cells, ttl_s=5.0)
    b = Coordinator(HaStore(engine), f"b{r}", "b:1", cells, ttl_s=5.0)
    listener = Listener(url)
    if wake:
        listener.on(LEASES_CHANNEL, lambda cell: b.wake())
        listener.start()
        while not listener.connected:
            await asyncio.sleep(0.005)
    try:
        await a.tick()
        assert set(a.owned()) == set(cells)
        b.start()
        while b.members != sorted([a.member_id, b.member_id]):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.5 + (r % 5) * 0.23)  # drain at a different point of b's tick
        t0 = time.perf_counter()
        await a.drain()
        while set(b.owned()) != set(cells):
            await asyncio.sleep(0.002)
        return time.perf_counter() - t0
    finally:
        await listener.stop()
        await b.drain()


def handoffs(url: str, rounds: int, wake: bool) -> list[float]:
    engine = make_engine(url)

    async def all_rounds() -> list[float]:
        return [await handoff_once(engine, url, r + (1000 if wake else 0), wake)
                for r in range(rounds)]  # fmt: skip

    try:
        return asyncio.run(all_rounds())
    finally:
        engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="config changes per LISTEN variant")
    ap.add_argument("--poll-n", type=int, default=10, help="config changes, poll only")
    ap.add_argument("--rounds", type=int, default=10, help="handoffs per variant")
    args = ap.parse_args()
    logs.configure("console", "warning")
    with database() as url:
        upgrade(url)
        engine = make_engine(url)
        ConfigRepository(engine).add_tenant(
            TenantConfig("acme", token_rate=Decimal(10), burst_tokens=1000)
        )
        engine.dispose()
        out: list[str] = []
        for poll_s in (30.0, 2.0):
            applied, delivered = config_delays(url, args.n, 0.05, config_poll_s=poll_s)
            out.append(line(f"config, LISTEN on, poll {poll_s:g} s: applied", applied))
            out.append(line("  (bare listener: notification delivered)", delivered))
        if args.poll_n:
            applied, _ = config_delays(
                url, args.poll_n, 2.0, config_poll_s=2.0, listen_notify=False
            )
            out.append(line("config, poll only (2 s): applied", applied))
        if args.rounds:
            out.append(line("handoff TTL 5 s, woken by NOTIFY", handoffs(url, args.rounds, True)))
            out.append(line("handoff TTL 5 s, own tick only", handoffs(url, args.rounds, False)))
    print("\n".join(out))


if __name__ == "__main__":
    main()
