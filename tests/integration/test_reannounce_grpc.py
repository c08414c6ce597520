"""Reannounce over gRPC on one server, restarted (the move between
replicas: tests/integration/ha/test_reannounce.py). SQLite and PostgreSQL.

Issue 30, item 2: Reannounce restored ids the server never admitted, billed
them at a multiplier the caller chose, and took a concurrency-1 tenant to
51 requests in flight. Now it restores only admissions this deployment
signed (the token of the Admit answer, with the key kept in the database,
so a restarted plane verifies what it issued before), at the signed
multiplier, and never past the tenant's concurrency cap.

Also: every time field is checked against the window Complete's are, so
that nothing restored can break a later export."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.protoclient import ProtoClient, pb
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.domain import TenantConfig
from controlplane.store.db import make_engine
from controlplane.store.signing import rotate
from tests.support import add_tenants

YEAR_10000 = 253_402_300_800  # 10000-01-01 in Unix seconds
OPEN = 51  # the count


def entry(rid: str, **kw: object) -> pb.OpenReservation:
    fields: dict[str, object] = {
        "tenant_id": "acme", "request_id": rid, "prompt_tokens": 10, "max_tokens": 20,
        "reserved_tokens": 30, "granted_max_tokens": 20,
    }  # fmt: skip
    return pb.OpenReservation(**(fields | kw))  # type: ignore[arg-type]


def held(a: pb.AdmitResponse, rid: str, **kw: object) -> pb.OpenReservation:
    """The entry a sidecar holding ``a`` (Admit of 10 + 20 tokens) re-announces."""
    return entry(rid, reservation_id=a.reservation_id, admission_token=a.admission_token, **kw)


def reannounce(target: str, *entries: pb.OpenReservation) -> pb.ReannounceResponse:
    with grpc.insecure_channel(target) as ch:
        res: pb.ReannounceResponse = pb_grpc.AdmissionServiceStub(ch).Reannounce(
            pb.ReannounceRequest(reservations=entries), timeout=10
        )
        return res


def test_reannounce_restores_only_what_this_plane_signed(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, tmp_path: Path
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 100_000, max_concurrency=1))
    first = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s1")
    with ProtoClient(first.target) as c:
        # the 51 admissions a concurrency-1 tenant can get one after another
        # (each completed before the next), and one left open
        tokens = []
        for i in range(OPEN):
            a = c.admit("acme", f"done-{i}", prompt_tokens=10, max_tokens=20)
            assert a.decision == pb.DECISION_ADMIT and a.admission_token, a
            tokens.append(a)
            c.complete("acme", f"done-{i}", prompt_tokens=10, generated_tokens=5)
        real = c.admit("acme", "real", prompt_tokens=10, max_tokens=20)
        assert real.decision == pb.DECISION_ADMIT
        assert real.pricing_multiplier == "1.000000"
    first.stop()  # a restart: the open reservation is lost with the memory

    srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s2")
    svc = srv.plane.service

    def inflight() -> int:
        return int(srv.on_loop(lambda: svc.views.tenant_state("acme"))["inflight"])

    # An id this plane never admitted: refused, nothing kept.
    got = reannounce(srv.target, entry("never-admitted", pricing_multiplier="1.000000"))
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED], got
    assert got.detail[0].startswith("unsigned"), got.detail
    assert srv.on_loop(lambda: svc.views.record("acme", "never-admitted")) is None
    # A real admission at a multiplier of the caller's: refused as altered.
    got = reannounce(srv.target, held(real, "real", pricing_multiplier="0.000001"))
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED], got
    assert got.detail[0].startswith("signature does not match: pricing_multiplier"), got.detail
    # ... or under another id, or with its tokens changed
    got = reannounce(srv.target, held(real, "other"), held(real, "real", granted_max_tokens=19,
                                                            reserved_tokens=29))  # fmt: skip
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED] * 2, got
    assert all(d == "signature does not match" for d in got.detail), got.detail
    assert inflight() == 0 and srv.on_loop(lambda: svc.views.open_reservations) == 0

    # As issued (the key lives in the database: the restarted plane verifies it).
    got = reannounce(srv.target, held(real, "real"))
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_RESTORED], got
    assert inflight() == 1
    # Concurrency 1 is held: the 51 earlier admissions, genuinely signed,
    # are not restored on top of it.
    got = reannounce(srv.target, *(held(a, f"done-{i}") for i, a in enumerate(tokens)))
    assert got.restored == 0 and got.refused == OPEN, got
    assert all(d.startswith("concurrency cap") for d in got.detail), set(got.detail)
    assert inflight() == 1
    with ProtoClient(srv.target) as c:
        done = c.complete("acme", "real", prompt_tokens=10, generated_tokens=5)
        assert (done.reserved_tokens, done.actual_tokens, done.refunded_tokens) == (30, 15, 15)
        assert done.pricing_multiplier == "1.000000"  # the signed one
    assert inflight() == 0


def test_an_older_key_verifies_after_one_rotation_and_not_after_two(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, tmp_path: Path
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 100_000))
    srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s1")
    with ProtoClient(srv.target) as c:
        a = [c.admit("acme", f"r{i}", prompt_tokens=10, max_tokens=20) for i in range(3)]
    srv.stop()
    # the operator's command (it runs beside the servers, on the database)
    done = CliRunner().invoke(app, ["keys", "rotate-signing-key", "--database-url", migrated_url])
    assert done.exit_code == 0 and "generation 2 is current" in done.stdout, done.stdout
    engine = make_engine(migrated_url)
    try:
        srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s2")
        got = reannounce(srv.target, held(a[0], "r0"))
        assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_RESTORED], got
        # it signs with generation 2 now, and accepts generation 1's
        ids = srv.on_loop(lambda: srv.plane.service.signer.key_ids)
        assert len(ids) == 2 and ids[1] == int.from_bytes(a[0].admission_token[1:5], "big")
        assert rotate(engine) == 3
        srv._run(srv.plane.poll_once())  # the config poll picks the rotation up
        got = reannounce(srv.target, held(a[1], "r1"))
        assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED], got
        assert "key this plane does not hold" in got.detail[0]
    finally:
        engine.dispose()


def test_a_configured_key_overrides_the_database(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, tmp_path: Path
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 100_000))
    key = "ab" * 32
    srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s1",
                      admission_signing_key=key)  # fmt: skip
    with ProtoClient(srv.target) as c:
        a = c.admit("acme", "r0", prompt_tokens=10, max_tokens=20)
        b = c.admit("acme", "r1", prompt_tokens=10, max_tokens=20)
    srv.stop()
    # the database's own key does not know it
    srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s2")
    got = reannounce(srv.target, held(a, "r0"))
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED], got
    srv.stop()
    # moved to _previous by a rotation of the setting: still accepted
    srv = make_server(migrated_url, clock=clock, ledger_spool_dir=tmp_path / "s3",
                      admission_signing_key="cd" * 32,
                      admission_signing_key_previous=key)  # fmt: skip
    got = reannounce(srv.target, held(b, "r1"))
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_RESTORED], got


@pytest.mark.parametrize("window", [YEAR_10000, 1])
def test_a_pricing_window_outside_the_admission_window_is_refused(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, window: int
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 10_000))
    srv = make_server(migrated_url, clock=clock)
    now_s = clock() // 10**9
    signer = srv.plane.service.signer  # as another replica sharing the key signs

    def signed(rid: str, pricing_window: int) -> pb.OpenReservation:
        token = signer.sign("acme", rid, "", "standard", "default", 10, 20, 0, 1.0,
                            pricing_window, clock())  # fmt: skip
        return entry(rid, admission_token=token)

    with grpc.insecure_channel(srv.target) as ch:
        stub = pb_grpc.AdmissionServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Reannounce(pb.ReannounceRequest(reservations=[
                signed("ok", 0), entry("far", pricing_window=window)]), timeout=10)  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("reservations[1].pricing_window: ")
        views = srv.plane.service.views
        assert srv.on_loop(lambda: views.record("acme", "ok")) is None  # nothing taken
        # a window of this clock's is restored, then settled and exported as any other
        got = stub.Reannounce(pb.ReannounceRequest(reservations=[signed("near", now_s - 60)]),
                              timeout=10)  # fmt: skip
        assert got.restored == 1, got
    with ProtoClient(srv.target) as c:
        done = c.complete("acme", "near", prompt_tokens=10, generated_tokens=5)
        assert done.actual_tokens == 15 and not done.duplicate
        assert done.pricing_window == now_s - 60


def test_an_oversized_token_names_the_field(
    migrated_url: str, make_server: Callable[..., Any], clock: Any
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 10_000))
    srv = make_server(migrated_url, clock=clock)
    with pytest.raises(grpc.RpcError) as err:
        reannounce(srv.target, entry("a"), entry("b", admission_token=b"\x01" * 5000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("reservations[1].admission_token: ")
