"""AdmitStream's answer to a batch decided at once, written as bytes
(``admitstream.batch_result_bytes``, through the selected ``fastpath.write_result``),
is byte for byte what the protobuf runtime serializes from the message
``admitstream.batch_result`` builds; the method's (de)serializers read columns and
write bytes or messages."""

from __future__ import annotations

from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.domain import Degradation, Pressure
from controlplane.rpc import admitstream
from controlplane.rpc.assembly import ADMIT_STREAM, ADMIT_STREAM_CODEC
from controlplane.service.answers import BatchResult

I64 = st.integers(-(2**63), 2**63 - 1)
TENANTS = ["acme", "beta", "é"]


def _fallback(tenant: str) -> str:
    return {"acme": "small", "beta": ""}.get(tenant, "tiny-é")


@st.composite
def results(draw: st.DrawFn) -> tuple[list[str], BatchResult]:
    n = draw(st.integers(0, 8))

    def col(values: st.SearchStrategy[Any]) -> list[Any]:
        return draw(st.lists(values, min_size=n, max_size=n))

    reasons = st.integers(0, 13)
    r = BatchResult(
        decision=col(st.integers(1, 2)), reason=col(reasons),
        retry_after_ms=col(st.one_of(st.integers(0, 100), I64)),
        reserved_tokens=col(I64), reservation_id=col(st.integers(0, 2**63 - 1)),
        granted_max_tokens=col(I64), bucket_remaining=col(I64), hourly_remaining=col(I64),
        daily_remaining=col(I64), duplicate=col(st.booleans()), shadow_reason=col(reasons),
        degraded=col(st.booleans()),
        pricing_multiplier=draw(st.sampled_from([1.0, 1.25, 0.5, 3.0])),
        degradation=draw(st.none() | st.builds(
            Degradation, I64, I64, st.sampled_from(["", "small", "é"]))),
        pressure=draw(st.none() | st.builds(
            Pressure, st.floats(0, 1), st.integers(1, 3),
            st.sampled_from(["", "fail_open", "fail_closed"]), st.booleans())),
        retryable=draw(st.none() | st.just(col(st.booleans()))),
        admission_token=draw(st.none() | st.just(col(st.binary(max_size=70)))),
    )  # fmt: skip
    return col(st.sampled_from(TENANTS)), r


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**64 - 1), results())
def test_bytes_are_the_runtimes(batch_id: int, tr: tuple[list[str], BatchResult]) -> None:
    tenant_ids, r = tr
    want = admitstream.batch_result(batch_id, r, _fallback, tenant_ids).SerializeToString()
    assert admitstream.batch_result_bytes(batch_id, r, _fallback, tenant_ids) == want


def test_the_codec_reads_columns_and_writes_bytes_or_messages() -> None:
    assert ADMIT_STREAM == "/burstgate.v1.AdmissionService/AdmitStream"
    assert ADMIT_STREAM_CODEC.message_type == "burstgate.v1.AdmitBatch"
    msg = pb.AdmitBatch(batch_id=4, tenant_id=["a", "a"], request_id=["x", "y"])
    data = msg.SerializeToString()
    batch = ADMIT_STREAM_CODEC.read(data)
    assert (batch.batch_id, batch.tenant_id, batch.request_id) == (4, ["a", "a"], ["x", "y"])
    assert batch.tenant_id[0] is batch.tenant_id[1]
    with pytest.raises(ValueError):
        ADMIT_STREAM_CODEC.read(b"\xff\xff\xff")
    res = pb.AdmitBatchResult(batch_id=4, decision=[pb.DECISION_ADMIT])
    assert ADMIT_STREAM_CODEC.write(res) == res.SerializeToString()
    assert ADMIT_STREAM_CODEC.write(b"\x08\x04") == b"\x08\x04"
