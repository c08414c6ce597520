"""The transport a sidecar in any language relies on, over a real server:
reflection under both protocol names, and the keepalive policy docs/api.md
documents (one test holds a stream open for a minute)."""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.protoclient import KEEPALIVE_OPTIONS, make_batch, pb
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controlplane.domain import TenantConfig
from controlplane.store.db import upgrade
from tests.support import add_tenants

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
# How long the keepalive test holds its stream open without sending anything:
# 15 pings, five times the three that end it under grpc's default policy
# (the test after it shows the GOAWAY coming within seconds).
HOLD_S = 15.0


def _start(url: str, make_server: Callable[..., Any], **settings: Any) -> Any:
    """A server on SQLite (nothing here depends on the database)."""
    upgrade(url)
    add_tenants(url, TenantConfig("acme", Decimal(1000), 10_000))
    return make_server(url, **settings)


@pytest.fixture
def server(sqlite_url: str, make_server: Callable[..., Any]) -> Any:
    return _start(sqlite_url, make_server)


# ------------------------------------------------------------------ reflection


def _v1_reflection(channel: grpc.Channel) -> Callable[..., Iterator[Any]]:
    # v1 and v1alpha messages are the same on the wire (only the package
    # differs), so v1alpha's classes encode a v1 client's requests.
    call: Callable[..., Iterator[Any]] = channel.stream_stream(
        V1_METHOD,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return call


def _ask(call: Callable[..., Iterator[Any]], *requests: Any) -> list[Any]:
    return list(call(iter(requests), timeout=10))


def _file_of(response: Any) -> descriptor_pb2.FileDescriptorProto:
    """The file that defines the asked-for symbol (sent first; its imports follow)."""
    assert response.WhichOneof("message_response") == "file_descriptor_response", response
    fd = descriptor_pb2.FileDescriptorProto()
    fd.ParseFromString(response.file_descriptor_response.file_descriptor_proto[0])
    return fd


def test_reflection_v1_lists_services_and_resolves_every_one(server: Any) -> None:
    with grpc.insecure_channel(server.target) as channel:
        v1 = _v1_reflection(channel)
        (listing,) = _ask(v1, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listing.list_services_response.service}
        assert {
            "burstgate.v1.AdmissionService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names
        # A client describing everything listed (`grpcurl describe`) asks
        # for each service's file: every one resolves, v1 reflection too.
        answers = _ask(
            v1,
            *(
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)
                for name in sorted(names)
            ),
        )
        for name, answer in zip(sorted(names), answers, strict=True):
            fd = _file_of(answer)
            package, _, service = name.rpartition(".")
            assert fd.package == package and service in {s.name for s in fd.service}, name
        admission = _file_of(
            _ask(
                v1,
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="burstgate.v1.AdmissionService"
                ),
            )[0]
        )
        methods = {m.name for s in admission.service for m in s.method}
        assert {"Admit", "Complete", "AdmitStream", "ReportLoad"} <= methods
        (missing,) = _ask(
            v1, reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")
        )
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_reflection_v1alpha_still_answers(server: Any) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listing, found = stub.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="burstgate.v1.AdmissionService"
                    ),
                ]
            ),
            timeout=10,
        )
        names = {s.name for s in listing.list_services_response.service}
        assert {"burstgate.v1.AdmissionService", "grpc.reflection.v1.ServerReflection"} <= names
        assert _file_of(found).package == "burstgate.v1"


# ------------------------------------------------------------------- keepalive


def _readme_keepalive() -> tuple[dict[str, int], str]:
    """The server options table of docs/api.md's "Keepalive" section, and the
    section's text."""
    text = API_DOC.read_text()
    section = text.split("### Keepalive", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(grpc\.[a-z0-9_.]+)` \| `(\d+)` \|", section, flags=re.M)
    return {name: int(value) for name, value in rows}, section


def _ping_every_second() -> list[tuple[str, int]]:
    """A client as aggressive as docs/api.md allows: a ping each second, also
    on a stream that sends nothing (grpc core's client otherwise stops
    after two pings until it sends data)."""
    return [
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _batch(batch_id: int, n: int = 3) -> pb.AdmitBatch:
    ids = [f"k{batch_id}-{i}" for i in range(n)]
    return make_batch(batch_id, ["acme"] * n, ids, [1] * n, [1] * n)


def test_admit_stream_survives_a_ping_a_second_for_fifteen_seconds(server: Any) -> None:
    outbox: queue.Queue[pb.AdmitBatch | None] = queue.Queue()
    with grpc.insecure_channel(server.target, options=_ping_every_second()) as channel:
        stream = pb_grpc.AdmissionServiceStub(channel).AdmitStream(
            iter(outbox.get, None), timeout=HOLD_S + 60
        )
        outbox.put(_batch(1))
        assert next(stream).batch_id == 1
        # About 15 pings and nothing else on the connection: under grpc's
        # default policy (5 min between client pings) the third ping would
        # end it with GOAWAY "too_many_pings", failing the stream.
        time.sleep(HOLD_S)
        outbox.put(_batch(2))
        answer = next(stream)
        assert answer.batch_id == 2
        assert list(answer.decision) == [pb.DECISION_ADMIT] * 3
        outbox.put(None)
        assert list(stream) == []
        assert stream.code() == grpc.StatusCode.OK


def test_pings_faster_than_the_server_allows_end_the_connection(
    sqlite_url: str, make_server: Callable[..., Any]
) -> None:
    # The same client against a server that allows a ping every 10 s: the
    # policy is enforced, so the test above shows the setting is what lets
    # a one-second client through.
    srv = _start(sqlite_url, make_server, keepalive_min_ping_interval_ms=10_000)
    outbox: queue.Queue[pb.AdmitBatch | None] = queue.Queue()
    with grpc.insecure_channel(srv.target, options=_ping_every_second()) as channel:
        stub = pb_grpc.AdmissionServiceStub(channel)
        stream = stub.AdmitStream(iter(outbox.get, None), timeout=60)
        outbox.put(_batch(1))
        assert next(stream).batch_id == 1
        with pytest.raises(grpc.RpcError) as err:
            next(stream)  # nothing more is sent: only the GOAWAY can end this
        outbox.put(None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()


def test_keepalive_policy_is_what_the_readme_says(
    sqlite_url: str, make_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[dict[str, Any]] = []
    real_server = grpc.aio.server

    def recording_server(*args: Any, **kwargs: Any) -> Any:
        built.append(dict(kwargs.get("options", ())))
        return real_server(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", recording_server)
    _start(sqlite_url, make_server)
    documented, section = _readme_keepalive()
    assert len(built) == 1
    server_keepalive = {k: v for k, v in built[0].items() if "ping" in k or "keepalive" in k}
    assert server_keepalive == documented
    # The Python client's options are the recommendation docs/api.md gives.
    for name, value in KEEPALIVE_OPTIONS:
        assert f"{name}: {value}" in section or f'"{name}": {value}' in section, name
    # ... and within the server's policy: never more often than once a second.
    client = dict(KEEPALIVE_OPTIONS)
    assert client["grpc.keepalive_time_ms"] >= 1000
    assert (
        client["grpc.keepalive_time_ms"]
        >= 2 * documented["grpc.http2.min_ping_interval_without_data_ms"]
    )
