"""How the request guard registers services with the grpc.aio server:
the admission and health services as grpc registered methods, the
operator services through generic handlers only (every registered method
adds a pending task that grpc.aio re-arms on each call the server takes)."""

from __future__ import annotations

from typing import Any

import grpc
from burstgate_client._proto.burstgate.v1 import admin_pb2_grpc, admission_pb2_grpc

from controlplane.rpc.guard import GuardedRegistrar, MalformedLog, Refused


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class FakeServer:
    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []
        self.registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, name: str, handlers: Any) -> None:
        self.registered[name] = handlers

    def lookup(self, method: str) -> grpc.RpcMethodHandler | None:
        details = Details(method)
        for h in self.generic:
            found = h.service(details)
            if found is not None:
                return found
        return None


def test_operator_services_are_served_through_generic_handlers_only() -> None:
    server = FakeServer()
    registrar = GuardedRegistrar(server, MalformedLog(), check=True, registered=False)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(
        admin_pb2_grpc.AdminServiceServicer(),  # type: ignore[abstract]
        registrar.as_server(),
    )
    assert server.registered == {}
    handler = server.lookup("/burstgate.v1.AdminService/GetTenant")
    assert handler is not None
    # guarded: bytes that are no message are refused, not raised
    assert isinstance(handler.request_deserializer(b"\xff\xff\xff"), Refused)
    assert server.lookup("/burstgate.v1.AdminService/NoSuchMethod") is None


def test_admission_service_stays_registered() -> None:
    server = FakeServer()
    registrar = GuardedRegistrar(server, MalformedLog(), check=False)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(
        admission_pb2_grpc.AdmissionServiceServicer(),  # type: ignore[abstract]
        registrar.as_server(),
    )
    methods = server.registered["burstgate.v1.AdmissionService"]
    assert "Admit" in methods
    assert isinstance(methods["Admit"].request_deserializer(b"\xff\xff\xff"), Refused)
