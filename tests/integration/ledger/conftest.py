"""Fixtures for metering over real gRPC: tenants, a price catalog, an admin
key for LedgerService, and helpers to read the ledger back with SQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import ledger_pb2_grpc as lpb_grpc
from burstgate_client.admin import authenticated_channel
from burstgate_client.protoclient import ProtoClient
from sqlalchemy import text

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.catalog import PriceEntry
from controlplane.domain.keys import Role
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine
from controlplane.store.keys import KeyStore
from controlplane.store.ledger import LedgerStore
from tests.support import wait_until

NS = 1_000_000_000

# Prices per million tokens: easy to check by hand.
ACME_PRICE = PriceEntry(
    tenant_id="acme",
    model="*",
    currency="USD",
    input_per_mtok=Decimal("2.00"),
    cached_input_per_mtok=Decimal("0.50"),
    output_per_mtok=Decimal("8.00"),
    gpu_prefill_per_mtok=Decimal("1.00"),
    gpu_decode_per_mtok=Decimal("4.00"),
    gpu_overhead_per_request=Decimal("0.0001"),
    lane_multipliers={"premium": Decimal("1.5")},
)
DEFAULT_PRICE = PriceEntry(
    tenant_id="*",
    model="*",
    currency="EUR",
    input_per_mtok=Decimal("1"),
    cached_input_per_mtok=Decimal("0.1"),
    output_per_mtok=Decimal("2"),
    gpu_prefill_per_mtok=Decimal("3"),
    gpu_decode_per_mtok=Decimal("9"),
    gpu_overhead_per_request=Decimal("0.001"),
)


def tenant(tenant_id: str, **kw: Any) -> TenantConfig:
    kw.setdefault("token_rate", Decimal(1_000_000))
    kw.setdefault("burst_tokens", 100_000_000)
    return TenantConfig(tenant_id=tenant_id, **kw)


def setup_db(url: str, *tenants: str, prices: tuple[PriceEntry, ...] = (ACME_PRICE,)) -> None:
    engine = make_engine(url)
    repo = ConfigRepository(engine)
    for t in tenants:
        repo.add_tenant(tenant(t))
    store = LedgerStore(engine)
    for p in prices:
        store.upsert_price(p)
    engine.dispose()


def admin_key(url: str, role: Role = Role.ADMIN) -> str:
    engine = make_engine(url)
    key, _ = KeyStore(engine).create_key("ledger-test", role, Actor("local:test", "local"))
    engine.dispose()
    return key


def ledger_rows(url: str, where: str = "1=1") -> list[Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return list(
                c.execute(
                    text(
                        f"SELECT * FROM ledger_records WHERE {where} ORDER BY tenant_id, request_id"
                    )
                )
            )
    finally:
        engine.dispose()


def ledger_rows_once(url: str, count: int, where: str = "1=1") -> list[Any]:
    """The ledger's rows once there are at least ``count``: an acknowledged
    Complete whose write ran past the writer's hang deadline on a loaded host
    is spooled and written on the next replay (about a second later), so a
    test that sent many reads the ledger when that has happened."""
    return wait_until(
        lambda: rows if len(rows := ledger_rows(url, where)) >= count else None,
        message=f"{count} ledger rows",
    )


def complete(c: ProtoClient, tenant_id: str, request_id: str, **kw: Any) -> pb.CompleteResponse:
    req = pb.CompleteRequest(tenant_id=tenant_id, request_id=request_id, **kw)
    resp: pb.CompleteResponse = c.stub.Complete(req, timeout=10)
    return resp


@dataclass
class Served:
    url: str
    srv: Any
    client: ProtoClient
    key: str

    def ledger(self) -> lpb_grpc.LedgerServiceStub:
        return lpb_grpc.LedgerServiceStub(authenticated_channel(self.srv.target, self.key))


@pytest.fixture
def served(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, tmp_path: Any
) -> Iterator[Served]:
    setup_db(migrated_url, "acme", "beta")
    key = admin_key(migrated_url)
    srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "spool")
    with ProtoClient(srv.target) as client:
        yield Served(migrated_url, srv, client, key)


def rpc_code(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    raise AssertionError("the call succeeded")
