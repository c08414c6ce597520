"""Regression (issue 12, bug 11): a call with two `authorization` entries
was decided by the first one. Differing entries are refused, whatever
their order and whether or not either is valid, on every kind of call; the
same entry twice is not ambiguous."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admin_pb2_grpc as apb_grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

from tests.integration.admin.conftest import Env, code_of


@pytest.mark.parametrize("env", [{"admission_auth": True}], indirect=True)
def test_two_authorization_entries_are_refused(env: Env) -> None:
    channel = grpc.insecure_channel(env.target)
    admission = pb_grpc.AdmissionServiceStub(channel)
    admin = apb_grpc.AdminServiceStub(channel)
    garbage = env.keys.sidecar[:-4] + "AAAA"
    req = pb.AdmitRequest(tenant_id="acme", request_id="x", prompt_tokens=1)
    pairs = [
        (env.keys.sidecar, garbage),  # the first valid: was admitted
        (garbage, env.keys.sidecar),
        (env.keys.admin, env.keys.sidecar),  # two valid keys of different roles
        (env.keys.sidecar, f"{env.keys.sidecar} "),  # not the same entry
    ]
    for first, second in pairs:
        md = (("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}"))
        calls: list[Callable[[], Any]] = [
            lambda: admission.Admit(req, metadata=md, timeout=10),  # noqa: B023
            lambda: list(
                admission.AdmitStream(iter([pb.AdmitBatch(batch_id=1)]), metadata=md, timeout=10)  # noqa: B023
            ),
            lambda: admin.ListTenants(apb.ListTenantsRequest(), metadata=md, timeout=10),  # noqa: B023
        ]
        for call in calls:
            code, details = code_of(call)
            assert (code, "ambiguous credentials" in details) == (
                grpc.StatusCode.UNAUTHENTICATED, True,
            ), details  # fmt: skip
    # Nothing was decided.
    counts = env.srv.on_loop(lambda: dict(env.srv.plane.service.stats.decision_counts))
    assert sum(counts.values()) == 0
    # One entry still works, and so does the same entry twice.
    ok = admission.Admit(req, metadata=(("authorization", f"Bearer {env.keys.sidecar}"),))
    assert ok.decision == pb.DECISION_ADMIT
    twice = (("authorization", f"Bearer {env.keys.admin}"),) * 2
    assert admin.ListTenants(apb.ListTenantsRequest(), metadata=twice, timeout=10).tenants
    channel.close()
