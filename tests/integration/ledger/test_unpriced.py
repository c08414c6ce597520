"""Issue 30 item 5: an empty price catalog never bills 0 silently.

Through the real doors (gRPC server on a free port, SQLite and PostgreSQL as
``migrated_url`` runs, and the CLI): ``burstgate config check`` names the
gap; with ``BURSTGATE_LEDGER_UNPRICED=refuse`` an Admit (unary and
AdmitStream) for a (tenant, model) without a price is refused
FAILED_PRECONDITION naming ``model`` before anything is reserved, and is
admitted once a price (or the default ('*', '*') price) exists; with the
default ``book`` a Complete is booked at 0, flagged price_id 0 and counted
in ``burstgate_ledger_unpriced_records``."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.domain.catalog import PriceEntry
from controlplane.store.db import make_engine
from controlplane.store.ledger import LedgerStore
from tests.conftest import ServerThread
from tests.integration.ledger.conftest import ledger_rows, setup_db
from tests.support import wait_until

ONE = Decimal(1)


def price(url: str, tenant: str, model: str) -> None:
    engine = make_engine(url)
    try:
        LedgerStore(engine).upsert_price(
            PriceEntry(tenant, model, "USD", ONE, ONE, ONE, ONE, ONE, Decimal(0))
        )
    finally:
        engine.dispose()


def test_config_check_names_what_the_catalog_leaves_unpriced(migrated_url: str) -> None:
    setup_db(migrated_url, "acme", "beta", prices=())
    runner = CliRunner()
    args = ["config", "check", "--database-url", migrated_url]
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 1, res.output
    assert "no default price ('*', '*')" in res.output
    assert "tenants without a price for every model: acme, beta" in res.output
    price(migrated_url, "acme", "*")  # acme is priced for every model; beta is not
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 1 and "every model: beta" in res.output, res.output
    price(migrated_url, "*", "*")  # the configured default price
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0 and res.output.startswith("ok: 2 tenants, 2 prices"), res.output


def _refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_refuse_mode_refuses_an_unpriced_admit_before_anything_is_reserved(
    migrated_url: str, make_server: Callable[..., ServerThread]
) -> None:
    setup_db(migrated_url, "acme", "beta", prices=())
    srv = make_server(migrated_url, ledger_unpriced="refuse", config_poll_s=0.2)
    stub = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(srv.target))
    ask = pb.AdmitRequest(tenant_id="acme", request_id="u1", prompt_tokens=10, max_tokens=10,
                          model="m1")  # fmt: skip
    err = _refused(lambda: stub.Admit(ask, timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert (err.details() or "").startswith("model: no price for tenant 'acme' and model 'm1'")
    assert srv.on_loop(lambda: srv.plane.service.views.record("acme", "u1")) is None
    batch = pb.AdmitBatch(batch_id=1, tenant_id=["beta", "acme"], request_id=["b1", "a1"],
                          prompt_tokens=[1, 1], max_tokens=[1, 1], model="m1")  # fmt: skip
    err = _refused(lambda: list(stub.AdmitStream(iter([batch]), timeout=10)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert "model: no price" in (err.details() or "")
    assert srv.on_loop(lambda: srv.plane.service.views.record("beta", "b1")) is None
    # A price for acme's m1 (picked up at the next catalog poll): acme is
    # admitted, beta still refused; then the default price covers beta.
    def admitted(tenant: str, rid: str) -> bool | None:
        try:
            r = stub.Admit(pb.AdmitRequest(tenant_id=tenant, request_id=rid, prompt_tokens=1,
                                           max_tokens=1, model="m1"), timeout=10)  # fmt: skip
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
            return None
        return r.decision == pb.DECISION_ADMIT or None

    price(migrated_url, "acme", "m1")
    wait_until(lambda: admitted("acme", "u2"), message="acme's price to be picked up")
    assert admitted("beta", "u3") is None
    assert srv.on_loop(lambda: srv.plane.service.views.record("beta", "u3")) is None
    price(migrated_url, "*", "*")
    wait_until(lambda: admitted("beta", "u4"), message="the default price to cover beta")


def test_book_mode_books_at_zero_loudly(
    migrated_url: str, make_server: Callable[..., ServerThread]
) -> None:
    setup_db(migrated_url, "acme", prices=())
    srv = make_server(migrated_url)  # BURSTGATE_LEDGER_UNPRICED=book, the default
    stub = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(srv.target))
    r = stub.Admit(pb.AdmitRequest(tenant_id="acme", request_id="z1", prompt_tokens=10,
                                   max_tokens=10, model="m1"), timeout=10)  # fmt: skip
    assert r.decision == pb.DECISION_ADMIT
    stub.Complete(pb.CompleteRequest(tenant_id="acme", request_id="z1", prompt_tokens=10,
                                     generated_tokens=5), timeout=10)  # fmt: skip
    [row] = wait_until(lambda: ledger_rows(migrated_url, "request_id = 'z1'") or None,
                       message="z1's row")  # fmt: skip
    assert (row.price_id, row.user_charge_nanos) == (0, 0)
    assert srv.plane.metering is not None and srv.plane.metering.unpriced == 1
