"""Revocation by another process: `burstgate keys revoke`, run as its own
process against the database a running server uses, reaches that server's
unary calls and its open AdmitStreams within one config poll (the bound
docs/operating.md states), on PostgreSQL.

The server's poll loop runs on a ManualClock: the poll happens when the
test moves simulated time by BURSTGATE_CONFIG_POLL_S, not before, so the
bound is shown without waiting for it in real time."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.admin import authenticated_channel

from controlplane.clock import ManualClock
from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from tests.conftest import ServerThread
from tests.support import add_tenants, wait_until

POLL_S = 5.0


def burstgate(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command, in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        capture_output=True, text=True, timeout=60, env=dict(os.environ), check=True,
    )  # fmt: skip


def test_a_key_revoked_by_the_cli_reaches_calls_and_open_streams_within_one_poll(
    pg_url: str, make_server: Callable[..., ServerThread]
) -> None:
    upgrade(pg_url)
    add_tenants(pg_url, TenantConfig("acme", Decimal(1000), 100_000))
    engine = make_engine(pg_url)
    token, info = KeyStore(engine).create_key(
        "edge", Role.SIDECAR, Actor("local:test", "local"), tenants=["acme"], pools=["*"]
    )
    engine.dispose()
    manual = ManualClock()
    # The poll's bound, so without LISTEN/NOTIFY (which would apply the
    # revocation at once: tests/integration/test_notify_server.py).
    srv = make_server(pg_url, clock=manual, sleep=manual.sleep, config_poll_s=POLL_S,
                      admission_auth=True, listen_notify=False)  # fmt: skip
    channel = authenticated_channel(srv.target, token)
    stub = pb_grpc.AdmissionServiceStub(channel)

    def admit(rid: str) -> pb.AdmitResponse:
        r: pb.AdmitResponse = stub.Admit(
            pb.AdmitRequest(tenant_id="acme", request_id=rid, prompt_tokens=10), timeout=10
        )
        return r

    outbox: queue.Queue[pb.AdmitBatch | None] = queue.Queue()

    def batches() -> Iterator[pb.AdmitBatch]:
        while (b := outbox.get(timeout=20)) is not None:
            yield b

    def batch(i: int) -> pb.AdmitBatch:
        return pb.AdmitBatch(batch_id=i, tenant_id=["acme"], request_id=[f"s{i}"],
                             prompt_tokens=[10], max_tokens=[0])  # fmt: skip

    stream = stub.AdmitStream(batches(), timeout=30)
    outbox.put(batch(1))
    assert list(next(stream).decision) == [pb.DECISION_ADMIT]
    assert admit("u1").decision == pb.DECISION_ADMIT

    out = burstgate("keys", "revoke", info.key_id, "--database-url", pg_url)
    assert out.stdout.strip() == f"key {info.key_id} revoked"
    # Until the next poll the server has not seen it: that is the bound.
    assert admit("u2").decision == pb.DECISION_ADMIT

    srv.on_loop(lambda: manual.advance(POLL_S))  # one poll interval passes

    tries: list[str] = []

    def refused() -> Any:
        tries.append(f"u3-{len(tries)}")  # a new id each time: no replay
        try:
            admit(tries[-1])
        except grpc.RpcError as err:
            return err
        return None

    err = wait_until(refused, message="the revocation to reach unary Admit")
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    # The open stream ends at its next batch, which is not decided.
    outbox.put(batch(2))
    try:
        next(stream)
        raise AssertionError("the revoked key's stream answered a batch")
    except grpc.RpcError as stream_err:
        assert stream_err.code() == grpc.StatusCode.UNAUTHENTICATED, stream_err.details()
    outbox.put(None)
    assert srv.on_loop(lambda: srv.plane.service.views.record("acme", "s2")) is None
    assert srv.on_loop(lambda: srv.plane.service.views.record("acme", tries[-1])) is None
    # The same poll wrote the key's last use: `keys list` (its own process) shows it.
    listed = json.loads(
        burstgate("keys", "list", "--all", "--json", "--database-url", pg_url).stdout
    )
    [row] = [k for k in listed if k["key_id"] == info.key_id]
    assert row["revoked"] and row["last_used"] and row["tenants"] == ["acme"]
    channel.close()
