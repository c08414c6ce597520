"""The transport a sidecar in any language relies on, over a real server:
reflection under both protocol names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controlplane.domain import TenantConfig
from controlplane.store.db import upgrade
from tests.support import add_tenants

V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


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
