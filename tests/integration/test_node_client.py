"""The cross-language contract test: a Node.js sidecar built from proto/
alone (clients/node/smoke.js: @grpc/proto-loader at run time, no generated
code) against a real server with sidecar tokens on, on SQLite and
PostgreSQL. What it prints is checked here: decisions, reasons, numbers and
the error statuses the protos promise.

Node and the npm packages come from `make install-test` (clients/node's
lock file); nothing is downloaded here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.admin import authenticated_channel

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.store.db import make_engine
from controlplane.store.keys import KeyStore
from tests.support import add_tenants

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


def sidecar_token(url: str) -> str:
    engine = make_engine(url)
    token, _ = KeyStore(engine).create_key(
        "node", Role.SIDECAR, Actor("local:test", "local"), tenants=["*"], pools=["*"]
    )
    engine.dispose()
    return token


def test_node_client_from_the_protos_alone(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, tmp_path: Path
) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir():
        pytest.fail("node or clients/node/node_modules is missing: run `make install-test`")
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10_000),
        TenantConfig(tenant_id="small", token_rate=Decimal(100), burst_tokens=1000, max_wait_ms=0),
    )
    token = sidecar_token(migrated_url)
    # The clock stands still while the client runs, so refill times are exact.
    srv = make_server(
        migrated_url, clock=clock, admission_auth=True, ledger_spool_dir=tmp_path / "spool"
    )
    # Empty small's bucket first: the client's 500 tokens then wait 5 s of refill.
    with authenticated_channel(srv.target, token) as channel:
        drain = pb_grpc.AdmissionServiceStub(channel).Admit(
            pb.AdmitRequest(tenant_id="small", request_id="drain", prompt_tokens=1000), timeout=5
        )
        assert drain.decision == pb.DECISION_ADMIT

    p = subprocess.run(
        [node, str(NODE_DIR / "smoke.js"), srv.target],
        env={**os.environ, "BURSTGATE_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)

    assert out["report"]["pool"] == "gpu-a" and out["report"]["engines_reporting"] == 1
    assert 0 <= out["report"]["load"] < 1

    admit = out["admit"]
    assert (admit["decision"], admit["reason"]) == ("DECISION_ADMIT", "REASON_UNSPECIFIED")
    assert (admit["reserved_tokens"], admit["granted_max_tokens"]) == (1156, 256)
    assert admit["remaining"] == {
        "bucket_tokens": 10_000 - 1156, "hourly_tokens": -1, "daily_tokens": -1
    }  # fmt: skip
    assert admit["retry_after_ms"] == 0 and admit["queue_wait_ms"] == 0
    assert admit["retryable"] is False and admit["duplicate"] is False
    assert admit["pricing_multiplier"] == "1.000000" and admit["lane"] == "standard"
    assert admit["pressure"]["freshness"] == "POOL_FRESHNESS_FRESH"
    assert admit["pressure"]["stale_policy"] == "STALE_POLICY_UNSPECIFIED"
    assert admit["reservation_id"] > 0
    # longs: Number gives numbers a sidecar can do arithmetic with
    assert out["bucket_plus_one"] == 10_000 - 1156 + 1
    assert out["types"] == {"bucket_tokens": "number", "reservation_id": "number",
                            "decision": "string"}  # fmt: skip

    again = out["again"]  # same id, other sizes: the original answer
    assert again["duplicate"] is True
    assert (again["reserved_tokens"], again["reservation_id"]) == (
        1156, admit["reservation_id"]
    )  # fmt: skip

    refused = out["refused"]
    assert (refused["decision"], refused["reason"]) == ("DECISION_REJECT", "REASON_TOKEN_RATE")
    # 5 s of refill, past the standard lane's 3 s SLO: not retryable (docs/gate.md)
    assert refused["retry_after_ms"] == 5000 and refused["retryable"] is False

    done = out["complete"]
    assert (done["reserved_tokens"], done["actual_tokens"], done["refunded_tokens"]) == (
        1156, 1020, 136
    )  # fmt: skip
    assert done["duplicate"] is False
    assert done["miss_rate_source"] == "MISS_RATE_SOURCE_REQUEST"
    assert done["pricing_multiplier"] == "1.000000" and done["kv_cache_miss_rate"] == 0.2

    stream = out["stream"]
    assert stream["error"] is None
    (batch,) = stream["results"]
    assert batch["batch_id"] == 7
    assert batch["decision"] == ["DECISION_ADMIT", "DECISION_ADMIT", "DECISION_REJECT"]
    assert batch["reason"] == ["REASON_UNSPECIFIED", "REASON_UNSPECIFIED", "REASON_UNKNOWN_TENANT"]
    assert batch["reserved_tokens"] == [15, 25, 0]
    assert batch["retry_after_ms"] == [0, 0, 0] and batch["retryable"] == [False] * 3
    assert batch["pricing_multiplier"] == "1.000000"

    assert out["bad_admit"]["code"] == "INVALID_ARGUMENT"
    assert out["bad_admit"]["details"].startswith("prompt_tokens")
    assert out["bad_stream"]["results"] == []
    assert out["bad_stream"]["error"]["code"] == "INVALID_ARGUMENT"
    assert out["bad_stream"]["error"]["details"].startswith("batch 9: prompt_tokens[1]")
    assert out["no_credentials"]["code"] == "UNAUTHENTICATED"

    # The server saw what the client says it did.
    state = srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme"))
    # acme: b-0 and b-1 are in flight; node-1 was settled
    assert (state["inflight"], state["inflight_tokens"]) == (2, 15 + 25)
