"""Every string field of every RPC has a maximum length, and no error quotes
more than a short prefix of a value (reliability issue, bug 6):
`Admit(lane="l"*10000)` ended RESOURCE_EXHAUSTED "Stream removed", the
unknown-lane message quoting the whole value back past grpc's metadata
limit.

The string fields are read from the proto descriptors, so a new field is
covered as soon as it exists: one character over its documented maximum
(controlplane/rpc/guard.py FIELD_LIMITS, docs/api.md "Errors") is
INVALID_ARGUMENT naming the field; at the maximum it is not a length error.
All over real gRPC."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2, admission_pb2, ledger_pb2
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from controlplane.domain.errors import MAX_ECHO_CHARS
from controlplane.rpc.guard import DEFAULT_MAX_LEN, FIELD_LIMITS, MAP_KEY_LIMITS, field_limit
from tests.integration.admin.conftest import Env

OPERATOR_SERVICES = [
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
    ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"],
]
ADMISSION = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"]
# A valid request of each admission method: one string at a time is made long.
ADMISSION_BASE: dict[str, Message] = {
    "Admit": pb.AdmitRequest(tenant_id="acme", request_id="r", prompt_tokens=1),
    "Complete": pb.CompleteRequest(tenant_id="acme", request_id="r", prompt_tokens=1),
    "GetLimits": pb.GetLimitsRequest(tenant_id="acme"),
    "GetCellOwners": pb.GetCellOwnersRequest(pool="p"),
    "ReportLoad": pb.LoadReport(pool="p", engine_id="e", max_batch_tokens=1),
    "AdmitStream": pb.AdmitBatch(
        tenant_id=["acme"], request_id=["r"], prompt_tokens=[1], max_tokens=[1]
    ),
}
# Longest message an error may carry here: the message of a field error plus
# the longest excerpt, far below grpc's 8 KiB metadata limit.
MAX_MESSAGE = 160


@dataclass
class Case:
    method: MethodDescriptor
    field: str  # as the error names it
    limit: int
    set_value: Callable[[Message, str], None]

    @property
    def id(self) -> str:
        return f"{self.method.name}:{self.field}"


def _setter(path: tuple[str, ...], name: str, how: str) -> Callable[[Message, str], None]:
    """How a case puts its value into a request: ``set`` a string,
    ``append`` to a repeated one, a map's ``key`` or ``value``."""

    def set_value(request: Message, value: str) -> None:
        target: Any = request
        for step in path:
            target = getattr(target, step)
        if how == "set":
            setattr(target, name, value)
        elif how == "append":
            getattr(target, name).append(value)
        elif how == "key":
            getattr(target, name)[value] = "1"
        else:
            getattr(target, name)["k"] = value

    return set_value


def _string_cases(
    method: MethodDescriptor,
    message: Descriptor,
    path: tuple[str, ...] = (),
    prefix: str = "",
) -> Iterator[Case]:
    """One case per string of ``message`` (nested singular messages, repeated
    entries, map keys and values), with how to set it on a request."""
    for fd in message.fields:
        name = fd.name
        if fd.type == FieldDescriptor.TYPE_STRING:
            limit = field_limit(fd)
            if fd.is_repeated:
                yield Case(method, f"{prefix}{name}[0]", limit, _setter(path, name, "append"))
            else:
                yield Case(method, f"{prefix}{name}", limit, _setter(path, name, "set"))
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            sub = fd.message_type
            assert sub is not None
            if sub.GetOptions().map_entry:
                if sub.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING:
                    limit = MAP_KEY_LIMITS.get(name, DEFAULT_MAX_LEN)
                    yield Case(method, f"{prefix}{name}", limit, _setter(path, name, "key"))
                if sub.fields_by_name["value"].type == FieldDescriptor.TYPE_STRING:
                    limit = FIELD_LIMITS.get(name, DEFAULT_MAX_LEN)
                    yield Case(method, f"{prefix}{name}[k]", limit, _setter(path, name, "value"))
            elif not fd.is_repeated:
                nested = f"{name}." if sub.full_name.startswith("google.protobuf.") else ""
                yield from _string_cases(method, sub, (*path, name), prefix + nested)


def operator_cases() -> list[Case]:
    return [
        case
        for service in OPERATOR_SERVICES
        for method in service.methods
        for case in _string_cases(method, method.input_type)
    ]


def admission_cases() -> list[Case]:
    return [
        case for method in ADMISSION.methods for case in _string_cases(method, method.input_type)
    ]


def _call(env: Env, method: MethodDescriptor, request: Message) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` with ``request`` (an admin key), without a stub."""
    channel = grpc.insecure_channel(env.target)
    output = GetMessageClass(method.output_type)
    path = f"/{method.containing_service.full_name}/{method.name}"
    metadata = (("authorization", f"Bearer {env.keys.admin}"),)
    try:
        if method.client_streaming:
            call = channel.stream_stream(path, lambda m: m.SerializeToString(), output.FromString)
            list(call(iter([request]), timeout=10, metadata=metadata))
        elif method.server_streaming:
            call = channel.unary_stream(path, lambda m: m.SerializeToString(), output.FromString)
            list(call(request, timeout=10, metadata=metadata))
        else:
            channel.unary_unary(path, lambda m: m.SerializeToString(), output.FromString)(
                request, timeout=10, metadata=metadata
            )
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        code: grpc.StatusCode = err.code()
        return code, err.details() or ""
    finally:
        channel.close()


def _request(case: Case, value: str) -> Message:
    base = ADMISSION_BASE.get(case.method.name)
    request = GetMessageClass(case.method.input_type)()
    if case.method.containing_service is ADMISSION:
        assert base is not None, f"add a valid base request for {case.method.name}"
        request.CopyFrom(base)
        # the long value replaces the base's own (a repeated column keeps one entry)
        name = case.field.split("[")[0]
        if name in request.DESCRIPTOR.fields_by_name:  # (not a nested message's own field)
            request.ClearField(name)
    case.set_value(request, value)
    return request


def test_every_string_is_covered() -> None:
    """The descriptors hold strings the tests below try: if a service or a
    field is renamed, this fails instead of the tests passing vacuously."""
    ids = {c.id for c in operator_cases()} | {c.id for c in admission_cases()}
    assert {"Admit:lane", "AdmitStream:lane[0]", "ReportLoad:engine_id", "CreateTenant:pool",
            "UpdatePolicy:set", "UpdatePolicy:set[k]", "UpdateTenant:update_mask.paths[0]",
            "SetPrice:lane_multipliers[k]", "ExportLedger:tenant_ids[0]"} <= ids  # fmt: skip


def _problems(env: Env, case: Case) -> list[str]:
    found: list[str] = []
    long_value = "x" * (case.limit + 1)
    code, details = _call(env, case.method, _request(case, long_value))
    shown = details.removeprefix("batch 0: ") if case.method.name == "AdmitStream" else details
    if (
        code != grpc.StatusCode.INVALID_ARGUMENT
        or not shown.startswith(f"{case.field}: ")
        or f"longer than {case.limit} characters" not in shown
    ):
        found.append(f"{case.id}: {case.limit + 1} chars -> {code.name} {details[:200]!r}")
    if len(details) > MAX_MESSAGE:
        found.append(f"{case.id}: a message of {len(details)} chars")
    at_limit = "x" * case.limit
    code, details = _call(env, case.method, _request(case, at_limit))
    if "longer than" in details or code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        found.append(f"{case.id}: {case.limit} chars -> {code.name} {details[:200]!r}")
    if case.limit > MAX_ECHO_CHARS and at_limit in details:
        found.append(f"{case.id}: the whole value quoted back: {details[:200]!r}")
    return found


def test_one_over_the_maximum_is_refused_naming_the_field(env: Env) -> None:
    """Every string of every request: limit + 1 characters is refused naming
    the field, nothing else in the request being wrong; exactly the limit
    is not a length error, and no message quotes it whole."""
    cases = operator_cases() + admission_cases()
    problems = [p for case in cases for p in _problems(env, case)]
    assert not problems, "\n".join(problems)


def test_the_issue_case_answers_invalid_argument(env: Env) -> None:
    stub = env.admission()
    with pytest.raises(grpc.RpcError) as err:
        stub.Admit(
            pb.AdmitRequest(tenant_id="acme", request_id="r", lane="l" * 10_000, prompt_tokens=1),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "lane: longer than 32 characters (10000)"
    # the same in a batch, by column and entry
    call = grpc.insecure_channel(env.target)
    try:
        stream = pb_grpc.AdmissionServiceStub(call).AdmitStream(
            iter([pb.AdmitBatch(batch_id=3, tenant_id=["acme"] * 2, request_id=["a", "b"],
                                lane=["standard", "l" * 10_000], prompt_tokens=[1, 1],
                                max_tokens=[1, 1])]),
            timeout=10,
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
    finally:
        call.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "batch 3: lane[1]: longer than 32 characters (10000)"


def test_errors_quote_only_a_prefix_of_a_value(env: Env) -> None:
    """Values within their bounds but long enough to matter are quoted as
    their first characters and their length: a NOT_FOUND tenant, an
    unparsable decimal, an unknown update-mask path."""
    from functools import partial

    from google.protobuf.field_mask_pb2 import FieldMask

    from tests.integration.admin.conftest import code_of

    tenant = "t" * 128
    code, details = code_of(
        partial(env.admin.call, "GetTenant", admin_pb2.GetTenantRequest(tenant_id=tenant))
    )
    assert code == grpc.StatusCode.NOT_FOUND and tenant not in details
    assert "'ttt" in details and "... (128 chars)" in details, details
    code, details = code_of(
        partial(
            env.admin.call,
            "CreateTenant",
            admin_pb2.CreateTenantRequest(
                tenant=admin_pb2.Tenant(tenant_id="n", token_rate="9" * 60 + "x", burst_tokens=1)
            ),
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "9" * 60 not in details, details
    assert details.startswith("token_rate: not a decimal number: '999"), details
    code, details = code_of(
        partial(
            env.admin.call,
            "UpdateTenant",
            admin_pb2.UpdateTenantRequest(
                tenant=admin_pb2.Tenant(tenant_id="acme"),
                update_mask=FieldMask(paths=["p" * 200]),
            ),
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "p" * 60 not in details, details
