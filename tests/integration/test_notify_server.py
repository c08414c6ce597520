"""A running server applies configuration changes as soon as they commit
(LISTEN/NOTIFY), with its config poll never firing: the server's loops run
on a ManualClock that the test never advances, so the poll's 30 s never
pass. Writes go through the store functions the CLI uses (ConfigRepository,
KeyStore, LedgerStore); the admin API writes through the same ones. The
delay itself is measured by bench/bench_notify.py, not asserted here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine

from controlplane.clock import ManualClock
from controlplane.domain import Decision, TenantConfig
from controlplane.domain.catalog import PriceEntry
from controlplane.domain.errors import Unauthenticated
from controlplane.domain.keys import Role
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from controlplane.store.ledger import LedgerStore
from controlplane.store.notify import CONFIG_CHANNEL
from tests.conftest import ServerThread
from tests.support import add_tenants, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

PRICE = PriceEntry(
    tenant_id="acme", model="*", currency="USD", input_per_mtok=Decimal("2"),
    cached_input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal("8"),
    gpu_prefill_per_mtok=Decimal("1"), gpu_decode_per_mtok=Decimal("4"),
    gpu_overhead_per_request=Decimal("0"),
)  # fmt: skip


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    upgrade(pg_url)
    add_tenants(pg_url, TenantConfig("acme", token_rate=Decimal(10), burst_tokens=1000))
    eng = make_engine(pg_url)
    yield eng
    eng.dispose()


def test_changes_apply_without_waiting_for_the_poll(
    engine: Engine, pg_url: str, make_server: Callable[..., ServerThread]
) -> None:
    manual = ManualClock()
    srv = make_server(pg_url, clock=manual, sleep=manual.sleep, config_poll_s=30)
    plane, svc = srv.plane, srv.plane.service
    assert plane.listener is not None
    wait_until(lambda: plane.listener.connected, message="the server's listener to connect")
    repo = ConfigRepository(engine)

    def rate() -> Decimal:
        got: Decimal = srv.on_loop(lambda: svc.views.tenant_limits("acme").token_rate)
        return got

    # A tenant's limits, then its admission decisions.
    repo.update_tenant("acme", {"token_rate": Decimal(25)})
    wait_until(lambda: rate() == Decimal(25), message="the new rate")
    repo.set_enabled("acme", False)

    ids = iter(range(1_000_000))

    def refused() -> bool:
        d = srv.on_loop(lambda: svc.admit("acme", f"r{next(ids)}", "", 10, 10))
        return d.decision is Decision.REJECT and d.reason.name == "TENANT_DISABLED"

    wait_until(refused, message="the disabled tenant to be refused")
    # A new tenant, a burst of changes coalesced (the last one wins).
    repo.add_tenant(TenantConfig("beta", token_rate=Decimal(1), burst_tokens=10))
    for r in range(2, 12):
        repo.update_tenant("beta", {"token_rate": Decimal(r)})
    wait_until(
        lambda: srv.on_loop(lambda: svc.views.tenant_limits("beta").token_rate) == Decimal(11),
        message="beta's last rate",
    )

    # A key: created, seen by the server's cache; revoked, refused.
    keys = KeyStore(engine)
    token, info = keys.create_key("edge", Role.SIDECAR, tenants=["acme"], pools=["*"])
    wait_until(lambda: plane.key_cache.lookup(token) is not None, message="the new key")
    keys.revoke_key(info.key_id)

    def revoked() -> bool:
        try:
            plane.key_cache.lookup(token)
        except Unauthenticated:
            return True
        return False

    wait_until(revoked, message="the revocation")

    # A price (the ledger's catalog).
    assert plane.metering is not None
    LedgerStore(engine).upsert_price(PRICE)
    wait_until(
        lambda: srv.on_loop(lambda: plane.metering.catalog.resolve("acme", "m")) is not None,
        message="the new price",
    )

    # None of it came through the poll: simulated time never moved.
    assert srv.on_loop(lambda: manual.sleepers) >= 1
    assert plane.notified_reloads >= 5
    assert plane.listener.received[CONFIG_CHANNEL] >= 16


def test_the_poll_still_applies_changes_without_listen(
    engine: Engine, pg_url: str, make_server: Callable[..., ServerThread]
) -> None:
    # listen_notify off (CockroachDB, PgBouncer in transaction mode): the
    # poll alone, as before; nothing listens.
    manual = ManualClock()
    srv = make_server(pg_url, clock=manual, sleep=manual.sleep, config_poll_s=30,
                      listen_notify=False)  # fmt: skip
    assert srv.plane.listener is None
    ConfigRepository(engine).update_tenant("acme", {"token_rate": Decimal(40)})
    srv.on_loop(lambda: manual.advance(30))

    def rate() -> Any:
        return srv.on_loop(lambda: srv.plane.service.views.tenant_limits("acme").token_rate)

    wait_until(lambda: rate() == Decimal(40), message="the poll to load the new rate")
    assert srv.plane.notified_reloads == 0
