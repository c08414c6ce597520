"""A fake engine on a free port, served from a thread of its own (the
official openai client under test is synchronous)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.fakeengine import FakeEngine
from controlplane.fakeengine.app import EngineConfig
from controlplane.sim.engine import EngineParams


class EngineThread:
    def __init__(self, params: EngineParams, cfg: EngineConfig, speed: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = self._run(self._make(params, cfg, speed))
        self.port: int = self._run(self.engine.start())

    @staticmethod
    async def _make(params: EngineParams, cfg: EngineConfig, speed: float) -> FakeEngine:
        return FakeEngine(params, cfg, speed=speed, port=0)  # built on the loop it runs on

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, by name and labels (``name{k=v,...}``)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items())
                    if k not in ("model_name", "engine")
                )  # fmt: skip
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        self._run(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., EngineThread]]:
    started: list[EngineThread] = []

    def make(
        params: EngineParams | None = None, *, speed: float = 20.0, **cfg: Any
    ) -> EngineThread:
        srv = EngineThread(params or EngineParams(), EngineConfig(**cfg), speed)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
