"""Structured errors over a real server: every error carries a google.rpc.Status
in grpc-status-details-bin with the call's own code and message (decoded with
grpc_status.rpc_status.from_call, which checks both), an ErrorInfo with the
reason docs/api.md documents, and a BadRequest naming the field on INVALID_ARGUMENT. The
auth interceptor's refusals: tests/integration/admin/test_auth.py; RetryInfo
on UNAVAILABLE: tests/integration/ledger/test_durability.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, make_batch, pb

from controlplane.domain import TenantConfig
from controlplane.rpc.errors import DOMAIN
from controlplane.store.db import upgrade
from tests.support import add_tenants, error_details


@pytest.fixture
def client(sqlite_url: str, make_server: Callable[..., Any]) -> Iterator[ProtoClient]:
    upgrade(sqlite_url)
    add_tenants(
        sqlite_url,
        TenantConfig("acme", Decimal(1000), 10_000),
        TenantConfig("beta", Decimal(1000), 2_000),
    )
    srv = make_server(sqlite_url)
    with ProtoClient(srv.target) as c:
        yield c


def _fails(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_invalid_admit_names_the_field(client: ProtoClient) -> None:
    err = _fails(lambda: client.admit("acme", "r1", prompt_tokens=-10, max_tokens=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "prompt_tokens: must be >= 0, got -10"  # unchanged text
    d = error_details(err)
    assert (d.info.reason, d.info.domain) == ("INVALID_FIELD", DOMAIN)
    assert dict(d.info.metadata) == {"field": "prompt_tokens"}
    assert d.bad_request is not None
    [violation] = d.bad_request.field_violations
    assert (violation.field, violation.description) == ("prompt_tokens", "must be >= 0, got -10")
    assert d.retry is None  # the same request fails the same way


def test_invalid_admit_stream_batch_names_batch_and_field(client: ProtoClient) -> None:
    good = make_batch(1, ["acme"] * 2, ["a", "b"], [1, 1], [1, 1])
    bad = make_batch(2, ["acme"] * 2, ["c", "d"], [1, -1], [1, 1])
    stream = client.admit_stream([good, bad])
    assert next(stream).batch_id == 1
    err = _fails(lambda: next(stream))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "batch 2: prompt_tokens[1]: must be >= 0, got -1"
    d = error_details(err)
    assert d.info.reason == "INVALID_FIELD"
    assert dict(d.info.metadata) == {"field": "prompt_tokens[1]", "batch_id": "2"}
    assert d.bad_request is not None
    assert [(v.field, v.description) for v in d.bad_request.field_violations] == [
        ("prompt_tokens[1]", "must be >= 0, got -1")
    ]


def test_complete_not_found_and_failed_precondition(client: ProtoClient) -> None:
    err = _fails(
        lambda: client.complete("acme", "never-admitted", prompt_tokens=1, generated_tokens=1)
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    d = error_details(err)
    assert (d.info.reason, d.info.domain) == ("NOT_FOUND", DOMAIN)
    assert d.info.metadata["field"] == "request_id"
    assert d.bad_request is None and d.retry is None
    # refused (bigger than beta's burst), then completed anyway
    refused = client.admit("beta", "huge", prompt_tokens=5000, max_tokens=0)
    assert refused.decision == pb.DECISION_REJECT
    err = _fails(lambda: client.complete("beta", "huge", prompt_tokens=1, generated_tokens=1))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(err).info.reason == "FAILED_PRECONDITION"
