"""Bytes that are not the method's protobuf (reliability issue, bug 8): they
answered UNKNOWN with the exception's class and logged a traceback per call,
a cheap way to flood the log. Now every method of every service the server
mounts answers INVALID_ARGUMENT "request is not a valid <MessageType>
protobuf" (ErrorInfo reason MALFORMED_REQUEST), and the log gets at most one
line per method per second, counting the calls it did not log. A caller the
auth check refuses is refused before its payload is read. Over real gRPC."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2, admission_pb2, ledger_pb2
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from structlog.testing import capture_logs

from tests.integration.admin.conftest import Env
from tests.support import error_details

# Not a protobuf message of any type: a varint that never ends.
GARBAGE = b"\xff\xff\xff"
ADMIT = "/burstgate.v1.AdmissionService/Admit"


def mounted_methods() -> Iterator[MethodDescriptor]:
    """Every method of every service the test server mounts."""
    for file in (admission_pb2, admin_pb2, ledger_pb2, health_pb2, reflection_pb2):
        for service in file.DESCRIPTOR.services_by_name.values():
            yield from service.methods


def call_raw(
    channel: grpc.Channel, method: MethodDescriptor, payload: bytes, key: str | None
) -> grpc.RpcError:
    """Send ``payload`` as the request of ``method``; return the error."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    metadata = () if key is None else (("authorization", f"Bearer {key}"),)
    try:
        if method.client_streaming:
            list(channel.stream_stream(path)(iter([payload]), timeout=10, metadata=metadata))
        elif method.server_streaming:
            list(channel.unary_stream(path)(payload, timeout=10, metadata=metadata))
        else:
            channel.unary_unary(path)(payload, timeout=10, metadata=metadata)
    except grpc.RpcError as err:
        return err
    raise AssertionError(f"{path} took {payload!r}")


@pytest.fixture
def channel(env: Env) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(env.target) as ch:
        yield ch


def test_every_method_answers_invalid_argument(
    env: Env, channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    methods = list(mounted_methods())
    assert len(methods) > 30  # admission, admin, ledger, health, reflection
    for method in methods:
        err = call_raw(channel, method, GARBAGE, env.keys.admin)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.full_name, err)
        assert err.details() == f"request is not a valid {method.input_type.full_name} protobuf"
        assert error_details(err).info.reason == "MALFORMED_REQUEST"
    # grpc logged nothing of its own: no "Unexpected [DecodeError]" traceback
    assert not [r for r in caplog.records if r.name.startswith("grpc")], caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_the_log_has_one_line_per_method_per_second(env: Env, channel: grpc.Channel) -> None:
    admit = next(m for m in mounted_methods() if m.name == "Admit")
    sent = 40
    with capture_logs() as logs:
        t0 = time.monotonic()
        for _ in range(sent):
            call_raw(channel, admit, GARBAGE, None)
        elapsed = time.monotonic() - t0
        lines = [e for e in logs if e["event"] == "malformed request"]
        assert 1 <= len(lines) <= int(elapsed) + 1, (elapsed, lines)
        assert lines[0]["method"] == ADMIT
        assert lines[0]["message_type"] == "burstgate.v1.AdmitRequest"
        assert lines[0]["bytes"] == len(GARBAGE) and lines[0]["log_level"] == "warning"
        assert "exc_info" not in lines[0] and "exception" not in lines[0]
        time.sleep(1.05)  # the next second: one more line, with the count it skipped
        call_raw(channel, admit, GARBAGE, None)
        lines = [e for e in logs if e["event"] == "malformed request"]
    logged = len(lines)
    assert sum(e["suppressed"] for e in lines) + logged == sent + 1, lines
    assert lines[-1]["suppressed"] > 0, lines


def test_grpcs_own_log_gets_no_traceback(env: Env, channel: grpc.Channel) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    grpc_log = logging.getLogger("grpc")
    grpc_log.addHandler(handler)
    try:
        admit = next(m for m in mounted_methods() if m.name == "Admit")
        for _ in range(5):
            call_raw(channel, admit, GARBAGE, None)
    finally:
        grpc_log.removeHandler(handler)
    assert records == []


@pytest.mark.parametrize("env", [{"admission_auth": True}], indirect=True)
def test_a_refused_caller_is_refused_before_its_payload_is_read(
    env: Env, channel: grpc.Channel
) -> None:
    by_name = {m.name: m for m in mounted_methods()}
    with capture_logs() as logs:
        for name, key in (("Admit", None), ("GetTenant", None), ("Admit", env.keys.viewer)):
            err = call_raw(channel, by_name[name], GARBAGE, key)
            assert err.code() in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            ), err
        assert not [e for e in logs if e["event"] == "malformed request"]
        # an authenticated caller's garbage is read, and refused as such
        err = call_raw(channel, by_name["Admit"], GARBAGE, env.keys.sidecar)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [e["method"] for e in logs if e["event"] == "malformed request"] == [ADMIT]
