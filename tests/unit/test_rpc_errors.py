"""controlplane/rpc/errors.py: every domain error maps to its own status and
ErrorInfo reason, docs/api.md documents each reason, and the details trailer
decodes to the call's code and message. (Over a real server:
tests/integration/test_error_details_grpc.py.)"""

from __future__ import annotations

import inspect
from pathlib import Path

import grpc
from google.rpc import error_details_pb2, status_pb2

from controlplane.domain import errors as domain
from controlplane.rpc import errors

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _details(status: grpc.Status) -> status_pb2.Status:
    [(key, value)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    decoded = status_pb2.Status.FromString(value)
    assert (decoded.code, decoded.message) == (status.code.value[0], status.details)
    return decoded


def test_every_domain_error_has_a_code_and_a_documented_reason() -> None:
    section = API_DOC.read_text().split("### Errors", 1)[1].split("\n## ", 1)[0]
    classes = [
        cls
        for _, cls in inspect.getmembers(domain, inspect.isclass)
        if issubclass(cls, domain.DomainError) and cls is not domain.DomainError
    ]
    reasons = set()
    for cls in classes:
        code, reason = errors._code_reason(cls.__new__(cls))
        assert code != grpc.StatusCode.INTERNAL, cls
        assert f"| `{reason}` | `{code.name}` |" in section, (cls, reason)
        reasons.add(reason)
    assert len(reasons) == len(classes)  # one reason per error, never shared
    assert f"| `{errors.INTERNAL[1]}` | `INTERNAL` |" in section


def test_unavailable_carries_retry_info_and_keeps_the_message() -> None:
    exc = domain.LedgerUnavailable("request_id: cannot look 'r1' up in the ledger; retry later")
    status = errors.error_status(exc)
    assert status.code == grpc.StatusCode.UNAVAILABLE
    assert status.details == str(exc)
    decoded = _details(status)
    retry = error_details_pb2.RetryInfo()
    info = error_details_pb2.ErrorInfo()
    assert [d.Unpack(m) for d, m in zip(decoded.details, (info, retry), strict=True)] == [True] * 2
    assert (info.reason, info.domain) == ("LEDGER_UNAVAILABLE", errors.DOMAIN)
    assert retry.retry_delay.ToSeconds() == 1


def test_internal_error_has_a_generic_message_and_error_info() -> None:
    status = errors.internal_status()
    assert (status.code, status.details) == (grpc.StatusCode.INTERNAL, errors.INTERNAL_MESSAGE)
    [detail] = _details(status).details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info) and info.reason == "INTERNAL"
