"""Fixtures for the SDK over real gRPC: a served control plane (SQLite and
PostgreSQL through ``migrated_url``), restartable on the same port, and a
TCP proxy in front of it that a test can cut to make it unreachable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from controlplane.settings import Settings
from tests.conftest import ServerThread
from tests.integration.ledger.proxy import TcpProxy
from tests.support import add_tenants


def tenant(tenant_id: str, **kw: Any) -> TenantConfig:
    kw.setdefault("token_rate", Decimal(1_000_000))
    kw.setdefault("burst_tokens", 100_000_000)
    return TenantConfig(tenant_id=tenant_id, **kw)


@dataclass
class Plane:
    """A control plane on a fixed port (``start`` again after ``stop``
    serves on the same port: the SDK's channel reconnects to it), and a
    proxy before it (``target``): ``proxy.cut()`` makes it unreachable."""

    url: str
    overrides: dict[str, Any]
    spool_dir: Path
    srv: ServerThread | None = None
    port: int = 0
    proxy: TcpProxy | None = None
    stopped: list[ServerThread] = field(default_factory=list)

    def start(self) -> ServerThread:
        values: dict[str, Any] = {
            "database_url": self.url, "host": "127.0.0.1", "port": self.port,
            "metrics_port": -1, "admission_auth": False, "ledger_spool_dir": self.spool_dir,
            # the default config poll (2 s): tenants are written before the start
            # admitted requests are not always completed here: the pool gate's
            # fallback (no load reports) must not be what refuses them
            "policy": Policy(gate_fallback_inflight=100_000),
        }  # fmt: skip
        self.srv = ServerThread(Settings(**(values | self.overrides)), time.time_ns)
        self.port = self.srv.port
        if self.proxy is None:
            self.proxy = TcpProxy(("127.0.0.1", self.port))
        return self.srv

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.stopped.append(self.srv)
            self.srv = None

    @property
    def target(self) -> str:
        assert self.proxy is not None
        return f"127.0.0.1:{self.proxy.port}"

    @property
    def direct(self) -> str:
        return f"127.0.0.1:{self.port}"


def planes_on(url: str, tmp_path: Path) -> Iterator[Callable[..., Plane]]:
    """A plane fixture's body: ``make(*tenants, **settings)`` starts a
    control plane on ``url`` (default tenants acme and beta); all stop after."""
    planes: list[Plane] = []

    def make(*tenants: TenantConfig, **overrides: Any) -> Plane:
        add_tenants(url, *(tenants or (tenant("acme"), tenant("beta"))))
        p = Plane(url, overrides, tmp_path / f"ledger-spool-{len(planes)}")
        p.start()
        planes.append(p)
        return p

    yield make
    for p in planes:
        p.stop()
        if p.proxy is not None:
            p.proxy.close()


@pytest.fixture
def plane_factory(migrated_url: str, tmp_path: Path) -> Iterator[Callable[..., Plane]]:
    yield from planes_on(migrated_url, tmp_path)


@pytest.fixture
def plane(plane_factory: Any) -> Plane:
    p: Plane = plane_factory()
    return p


async def until(predicate: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    """Await ``predicate()`` turning true (state another task changes),
    bounded generously; an AssertionError says what was waited for."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


# The deadline of clients whose test is not about deadlines: these machines
# are shared and slow, and a missed 250 ms default would turn into the
# FailPolicy's answer, which such a test does not expect.
SLOW_OK = 10.0
