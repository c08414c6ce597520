"""Server reflection under both names clients ask for: ``grpc.reflection.v1``
(current grpcurl, grpc-go and grpc-java tooling, Postman) and the older
``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha. The v1 protocol is the same messages
under another package name (same field names, numbers and types), so the v1
method is the v1alpha servicer behind the v1alpha (de)serializers. Both names
are listed, and both resolve: the v1 service's file (v1alpha's, renamed) is
kept in a private pool that is asked after the default one, so that a client
describing every listed service (``grpcurl describe``) does not fail on v1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
SERVICES = (V1_SERVICE, V1ALPHA_SERVICE)


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto as grpc.reflection.v1 (what upstream's
    grpc/reflection/v1/reflection.proto declares, less its options)."""
    old, new = reflection_pb2.DESCRIPTOR.package, "grpc.reflection.v1"
    fd = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fd)
    fd.name = "grpc/reflection/v1/reflection.proto"
    fd.package = new
    fd.ClearField("options")  # v1alpha's are deprecated=true and its java/go packages
    for message in fd.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message and enum fields only
                field.type_name = field.type_name.replace(f".{old}.", f".{new}.")
    for service in fd.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    return fd


class _Pools:
    """The lookups the reflection servicer makes, in the default pool first,
    then in ``extra`` (kept apart so that nothing else in the process sees a
    second definition of the reflection messages)."""

    def __init__(self, extra: descriptor_pool.DescriptorPool) -> None:
        self._default = descriptor_pool.Default()
        self._extra = extra

    def _find(self, method: str, name: str) -> Any:
        try:
            return getattr(self._default, method)(name)
        except KeyError:
            return getattr(self._extra, method)(name)

    def FindFileByName(self, name: str) -> Any:
        return self._find("FindFileByName", name)

    def FindFileContainingSymbol(self, name: str) -> Any:
        return self._find("FindFileContainingSymbol", name)

    def FindMessageTypeByName(self, name: str) -> Any:
        return self._find("FindMessageTypeByName", name)

    # Extensions: the v1 file declares none, so only the default pool has any.
    def FindExtensionByNumber(self, message: Any, number: int) -> Any:
        return self._default.FindExtensionByNumber(message, number)

    def FindAllExtensions(self, message: Any) -> Any:
        return self._default.FindAllExtensions(message)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) listing ``service_names`` and both
    reflection services."""
    extra = descriptor_pool.DescriptorPool()
    extra.Add(_v1_file())
    servicer = reflection.aio.ReflectionServicer([*service_names, *SERVICES], pool=_Pools(extra))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    methods = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    # As generated code registers a service: both the generic and the
    # registered-method tables.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, methods),))
    server.add_registered_method_handlers(V1_SERVICE, methods)
