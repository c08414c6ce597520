"""The sidecar end to end: a real control plane on PostgreSQL (restartable
on its port, reached through a TCP proxy: tests/integration/sdk/conftest.py),
a fake engine, the sidecar on the SDK's client, and the official openai
client as the application."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from burstgate_client.sidecar import Sidecar, load
from burstgate_client.sidecar.sdkclient import sdk_client
from prometheus_client.parser import text_string_to_metric_families

from controlplane.fakeengine import FakeEngine
from controlplane.fakeengine.app import EngineConfig
from controlplane.store.db import upgrade
from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import Plane, planes_on
from tests.support import wait_until

MODEL = "fake-llama"
KEYS = {"sk-acme": "acme", "sk-beta": "beta"}


class Stack:
    """A fake engine and the sidecar in front of it, on one event loop in a
    thread of their own (the openai client under test is synchronous)."""

    def __init__(self, control_plane: str, *, speed: float, model: str, **cfg: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._clients: dict[tuple[str, int], openai.OpenAI] = {}
        self._run(self._start(control_plane, speed, model, cfg))

    async def _start(self, control_plane: str, speed: float, model: str,
                     cfg: dict[str, Any]) -> None:  # fmt: skip
        self.engine = FakeEngine(cfg=EngineConfig(model=model), speed=speed, port=0)
        await self.engine.start()
        cfg.setdefault("metrics", {"interval_s": 0.1})
        if "spool_path" not in cfg:  # the command's default (a file in the working directory): off
            cfg.setdefault("spool", False)
        self.cfg = load(upstream=f"http://127.0.0.1:{self.engine.port}",
                        control_plane=control_plane, port=0, api_keys=KEYS, **cfg)  # fmt: skip
        self.admitter = sdk_client(self.cfg)
        self.sidecar = Sidecar(self.cfg, self.admitter)
        await self.sidecar.start()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar.port}"

    def client(self, key: str = "sk-acme", max_retries: int = 0) -> openai.OpenAI:
        """One client per key and retry count, closed with the stack."""
        if (key, max_retries) not in self._clients:
            self._clients[key, max_retries] = openai.OpenAI(
                base_url=self.url + "/v1", api_key=key, max_retries=max_retries
            )
        return self._clients[key, max_retries]

    def pending(self) -> int:
        n: int = self.admitter.pending_completions
        return n

    def metrics(self, port: int | None = None) -> dict[str, float]:
        """The sidecar's (or, with the engine's port, the engine's) samples,
        by name and labels other than the engine's own."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port or self.sidecar.port}/metrics",
                                    timeout=10) as r:  # fmt: skip
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k not in ("model_name", "engine"))  # fmt: skip
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def engine_metrics(self) -> dict[str, float]:
        return self.metrics(self.engine.port)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        for c in self._clients.values():
            c.close()

        async def stop() -> None:
            await self.sidecar.stop()
            await self.admitter.aclose()
            await self.engine.stop()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def pg_plane(pg_url: str, tmp_path: Path) -> Iterator[Callable[..., Plane]]:
    """``make(*tenants, **settings)``: a control plane on a fresh PostgreSQL
    database (default tenants acme and beta, no rate pressure)."""
    upgrade(pg_url)
    yield from planes_on(pg_url, tmp_path)


@pytest.fixture
def make_stack() -> Iterator[Callable[..., Stack]]:
    stacks: list[Stack] = []

    def make(plane: Plane, *, speed: float = 20.0, model: str = MODEL, **cfg: Any) -> Stack:
        s = Stack(plane.target, speed=speed, model=model, **cfg)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.stop()


def rows(plane: Plane, n: int, where: str = "1=1") -> list[Any]:
    """The ledger's rows once there are ``n`` of them (Completes are sent in
    the background, after the answer)."""
    wait_until(lambda: len(ledger_rows(plane.url, where)) >= n or None,
               message=f"{n} ledger rows")  # fmt: skip
    time.sleep(0.2)  # and no more than that
    final = ledger_rows(plane.url, where)
    assert len(final) == n, final
    return final
