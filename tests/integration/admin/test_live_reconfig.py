"""A limit change applies to Admit decisions while a load of Admit calls
runs, without errors, without resetting other tenants' buckets and without
dropping in-flight requests. (The config poll is 600 s here: the admin call
itself applies the change.)"""

from __future__ import annotations

import threading
import time

import grpc
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from google.protobuf.field_mask_pb2 import FieldMask

from tests.integration.admin.conftest import Env
from tests.support import wait_until

MAX_CALLS = 20_000  # the load loop's bound
AFTER_CHANGE = 200  # calls the loop makes once the change has returned


def test_limit_change_under_load(env: Env) -> None:
    # Slow tenant: 1 token/s, burst 1000; each request costs 100 tokens.
    env.admin.call(
        "CreateTenant",
        apb.CreateTenantRequest(
            tenant=apb.Tenant(tenant_id="slow", token_rate="1", burst_tokens=1000)
        ),
    )
    inflight = env.admit("slow", "held", prompt=100)
    assert inflight.decision == pb.DECISION_ADMIT
    # beta (rate 1/s, burst 5000) spends 3000: its level must survive the change.
    assert env.admit("beta", "b1", prompt=3000).decision == pb.DECISION_ADMIT
    beta_before = env.viewer.call("GetTenantState", apb.GetTenantStateRequest(tenant_id="beta"))

    decisions: list[tuple[float, int]] = []
    errors: list[BaseException] = []
    changed_at: list[float] = []
    stop = threading.Event()

    def load() -> None:
        stub = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(env.target))
        after = 0
        for i in range(MAX_CALLS):
            sent = time.monotonic()  # decided after this instant
            try:
                r = stub.Admit(
                    pb.AdmitRequest(tenant_id="slow", request_id=f"L{i}", prompt_tokens=100),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                errors.append(exc)
                return
            decisions.append((sent, r.decision))
            if r.decision == pb.DECISION_ADMIT:  # done at once, as a sidecar reports it
                stub.Complete(
                    pb.CompleteRequest(tenant_id="slow", request_id=f"L{i}", prompt_tokens=100),
                    timeout=10,
                )
            if changed_at:
                after += 1
                if after >= AFTER_CHANGE:
                    return
            if stop.is_set():
                return

    worker = threading.Thread(target=load)
    worker.start()
    # Let the load drain the bucket and get refused for a while.
    wait_until(
        lambda: sum(1 for _, d in decisions if d == pb.DECISION_REJECT) >= 50,
        message="50 refusals of the slow tenant",
        timeout=30,
        interval=0.01,
    )
    updated = env.admin.call(
        "UpdateTenant",
        apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="slow", token_rate="1000000", burst_tokens=10_000_000),
            update_mask=FieldMask(paths=["token_rate", "burst_tokens"]),
        ),
    )
    changed_at.append(time.monotonic())
    worker.join(timeout=60)
    stop.set()
    assert not worker.is_alive()
    assert errors == []
    assert updated.token_rate == "1000000"
    # Calls sent after the change returned; the ones in between are either.
    before = [d for t, d in decisions if t < changed_at[0]]
    after = [d for t, d in decisions if t > changed_at[0]]
    assert pb.DECISION_REJECT in before[-20:]
    assert len(after) >= AFTER_CHANGE - 2
    # Once the call returned, the new limits decide: everything is admitted.
    assert after and all(d == pb.DECISION_ADMIT for d in after), after[:20]
    # The request admitted before the change is still open and settles.
    done = env.admission().Complete(
        pb.CompleteRequest(tenant_id="slow", request_id="held", prompt_tokens=100)
    )
    assert (done.reserved_tokens, done.duplicate) == (100, False)
    # beta's bucket was not reset (it refills at 1 token/s).
    beta_after = env.viewer.call("GetTenantState", apb.GetTenantStateRequest(tenant_id="beta"))
    elapsed = beta_after.as_of.ToNanoseconds() - beta_before.as_of.ToNanoseconds()
    assert beta_before.bucket_tokens <= beta_after.bucket_tokens
    assert beta_after.bucket_tokens <= beta_before.bucket_tokens + elapsed // 1_000_000_000 + 1
    assert beta_after.bucket_tokens < 5000


def test_a_new_tenant_is_admitted_on_every_door_once_create_returns(env: Env) -> None:
    """AdmitStream never waits for a share of a tenant's limits (a batch
    would hold up the stream), so CreateTenant gives this replica one
    before it answers: the first batch is decided as the first Admit is."""
    from burstgate_client.protoclient import ProtoClient, make_batch

    for i, door in enumerate(("stream", "unary")):
        tid = f"fresh-{door}"
        env.admin.call("CreateTenant", apb.CreateTenantRequest(
            tenant=apb.Tenant(tenant_id=tid, token_rate="1000", burst_tokens=10_000)))  # fmt: skip
        if door == "stream":
            with ProtoClient(env.target) as c:
                (res,) = c.admit_stream([make_batch(i + 1, [tid], ["r1"], [10], [10])])
            assert list(res.decision) == [pb.DECISION_ADMIT], res
        else:
            assert env.admit(tid, "r1", prompt=10).decision == pb.DECISION_ADMIT
