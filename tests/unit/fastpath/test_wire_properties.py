"""Property tests of the AdmitStream wire codec: both builds against the protobuf runtime.

Reading: for random AdmitBatch messages serialized by the runtime, for hand-built
encodings the runtime never writes (fields out of order, packed and unpacked numbers
mixed, singular fields repeated, unknown fields of every wire type, groups, overlong
varints and lengths, wrong wire types for known fields) and for random bytes and
mutations of valid encodings, both readers give exactly what
``AdmitBatch.FromString`` gives, or refuse exactly when it raises.

Writing: for random result columns both writers give the bytes
``AdmitBatchResult(...).SerializeToString()`` gives, or both raise when the runtime
refuses the values.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastpath import _wire_py

from .conftest import compiled

FIELDS = (
    "batch_id", "tenant_id", "request_id", "lane", "prompt_tokens", "max_tokens", "model",
    "pool", "max_wait_ms", "retry_key", "attempt",
)  # fmt: skip
REPEATED = {"tenant_id", "request_id", "lane", "prompt_tokens", "max_tokens", "max_wait_ms",
            "retry_key", "attempt"}  # fmt: skip
I64 = (-(2**63), 2**63 - 1)
U64 = (0, 2**64 - 1)


def _builds() -> list[ModuleType]:
    return [_wire_py, compiled("_wire_c")]


@pytest.fixture(params=["python", "cython"])
def wire(request: pytest.FixtureRequest) -> ModuleType:
    return _wire_py if request.param == "python" else compiled("_wire_c")


def _runtime(data: bytes) -> dict[str, Any] | None:
    try:
        msg = pb.AdmitBatch.FromString(data)
    except DecodeError:
        return None
    return {f: list(getattr(msg, f)) if f in REPEATED else getattr(msg, f) for f in FIELDS}


def _ours(build: ModuleType, data: bytes) -> dict[str, Any] | None:
    try:
        cols = build.read_batch(data)
    except build.WireError:
        return None
    out = {f: getattr(cols, f) for f in FIELDS}
    for f in REPEATED:
        assert type(out[f]) is list
    for column in (cols.tenant_id, cols.lane):  # equal ids: one object
        first: dict[str, str] = {}
        for text in column:
            assert first.setdefault(text, text) is text
    return out


def _agree(data: bytes) -> dict[str, Any] | None:
    want = _runtime(data)
    for build in _builds():
        assert _ours(build, data) == want, build.__name__
    return want


# ------------------------------------------------------------ runtime-written messages

texts = st.text(max_size=12)
ids = st.one_of(st.sampled_from(["acme", "beta", "é", "", "a" * 130]), texts)
i64s = st.integers(*I64)
u32s = st.integers(0, 2**32 - 1)
numbers = st.one_of(st.integers(-3, 300), i64s)


@st.composite
def batches(draw: st.DrawFn) -> pb.AdmitBatch:
    n = draw(st.integers(0, 12))
    return pb.AdmitBatch(
        batch_id=draw(st.one_of(st.integers(0, 5), st.integers(*U64))),
        tenant_id=draw(st.lists(ids, min_size=n, max_size=n)),
        request_id=draw(st.lists(texts, max_size=n + 1)),
        lane=draw(st.lists(st.sampled_from(["", "standard", "batch", "é"]), max_size=n)),
        prompt_tokens=draw(st.lists(numbers, max_size=n)),
        max_tokens=draw(st.lists(numbers, max_size=n)),
        model=draw(texts),
        pool=draw(texts),
        max_wait_ms=draw(st.lists(numbers, max_size=3)),
        retry_key=draw(st.lists(texts, max_size=3)),
        attempt=draw(st.lists(u32s, max_size=3)),
    )


@settings(max_examples=300, deadline=None)
@given(batches())
def test_reads_what_the_runtime_writes(msg: pb.AdmitBatch) -> None:
    assert _agree(msg.SerializeToString()) is not None


# ------------------------------------------------------------ hand-built encodings


def varint(value: int, pad: int = 0) -> bytes:
    """``value`` (negative: its 64-bit pattern) with ``pad`` redundant bytes."""
    value &= 2**64 - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    if pad:
        out.append(value | 0x80)
        out += b"\x80" * (pad - 1)
        out.append(0)
    else:
        out.append(value)
    return bytes(out)


def tag(field: int, wire: int, pad: int = 0) -> bytes:
    return varint(field << 3 | wire, pad)


def delimited(field: int, body: bytes, pad: int = 0) -> bytes:
    return tag(field, 2) + varint(len(body), pad) + body


pads = st.sampled_from([0, 0, 0, 0, 1, 3, 5])
utf8 = st.one_of(texts.map(lambda t: t.encode()), st.binary(max_size=4))


@st.composite
def unknown(draw: st.DrawFn, depth: int = 0) -> bytes:
    field = draw(st.one_of(st.integers(12, 40), st.integers(1, 2**29 - 1)))
    wire = draw(st.sampled_from([0, 1, 2, 5, 3] if depth < 3 else [0, 1, 2, 5]))
    if wire == 0:
        return tag(field, 0) + varint(draw(i64s), draw(pads))
    if wire == 1:
        return tag(field, 1) + draw(st.binary(min_size=8, max_size=8))
    if wire == 5:
        return tag(field, 5) + draw(st.binary(min_size=4, max_size=4))
    if wire == 2:
        return delimited(field, draw(st.binary(max_size=6)))
    inner = b"".join(draw(st.lists(unknown(depth + 1), max_size=3)))
    return tag(field, 3) + inner + tag(field, 4)


@st.composite
def piece(draw: st.DrawFn) -> bytes:
    """One field of an AdmitBatch as some encoder might write it."""
    kind = draw(st.sampled_from(
        ["batch_id", "string", "number", "packed", "single_string", "unknown", "wrong"]
    ))  # fmt: skip
    if kind == "batch_id":
        return tag(1, 0, draw(pads)) + varint(draw(st.integers(*U64)), draw(pads))
    if kind == "string":
        field = draw(st.sampled_from([2, 3, 4, 10]))
        return delimited(field, draw(utf8), draw(pads))
    if kind == "single_string":
        return delimited(draw(st.sampled_from([7, 8])), draw(utf8), draw(pads))
    field = draw(st.sampled_from([5, 6, 9, 11]))
    values = st.one_of(i64s, st.integers(0, 2**64 - 1), st.integers(-5, 5))
    if kind == "number":
        return tag(field, 0) + varint(draw(values), draw(pads))
    if kind == "packed":
        body = b"".join(varint(v, draw(pads)) for v in draw(st.lists(values, max_size=4)))
        return delimited(field, body)
    if kind == "wrong":  # a known field number with a wire type it does not take
        field = draw(st.integers(1, 11))
        wire = draw(st.sampled_from([0, 1, 5, 3]))
        if wire == 3:
            return tag(field, 3) + tag(field, 4)
        if wire == 0:
            return tag(field, 0) + varint(draw(values))
        return tag(field, wire) + bytes(8 if wire == 1 else 4)
    return draw(unknown())


encodings = st.lists(piece(), max_size=12).map(b"".join)


@settings(max_examples=500, deadline=None)
@given(encodings)
@example(tag(11, 0) + varint(2**32 + 5))  # uint32: the low 32 bits
@example(tag(5, 0) + varint(-1))  # int64: 10 bytes
@example(tag(1, 0) + b"\xff" * 9 + b"\x7f")  # bits past the 64th dropped
@example(delimited(7, b"a") + delimited(7, b"b") + tag(1, 0) + b"\x05" + tag(1, 0) + b"\x06")
@example(delimited(5, b"") + tag(5, 0) + b"\x01" + delimited(5, b"\x02\x03"))
@example(tag(1, 0, 4) + b"\x05")  # a 5-byte tag
@example(delimited(7, b"x", 4))  # a 5-byte length
def test_reads_any_valid_encoding(data: bytes) -> None:
    _agree(data)


# ------------------------------------------------------------ malformed bytes

refused_examples = [
    b"\x00\x01",  # field number 0
    tag(1, 0, 5) + b"\x05",  # a 6-byte tag
    b"\x88\x80\x80\x80\x10\x05",  # a tag of 2**32 or more
    tag(1, 0) + b"\xff" * 10 + b"\x01",  # an 11-byte varint
    tag(7, 2) + b"\x81\x80\x80\x80\x80\x00x",  # a 6-byte length
    b"\x0c",  # an end group with no group
    tag(20, 3) + tag(21, 4),  # a group ended by another field number
    tag(20, 3),  # a group never ended
    b"\x0e",  # wire type 6
    b"\x0f",  # wire type 7
    delimited(7, b"\xed\xa0\x80"),  # an encoded surrogate
    delimited(2, b"\xc0\x80"),  # an overlong encoding
    delimited(3, b"\xff"),
    delimited(5, b"\x80\x80"),  # a packed varint past its length
    tag(1, 0) + b"\x80",  # a varint past the end
    tag(20, 1) + b"\x00\x00",  # a fixed64 past the end
    tag(20, 5) + b"\x00",
    tag(7, 2) + b"\x05ab",  # a length past the end
    tag(20, 3) * 101 + tag(20, 4) * 101,  # groups nested deeper than 100
]


@pytest.mark.parametrize("data", refused_examples)
def test_refuses_what_the_runtime_refuses(data: bytes) -> None:
    assert _runtime(data) is None
    _agree(data)


def test_groups_nested_100_deep_are_read() -> None:
    data = tag(20, 3) * 100 + tag(20, 4) * 100 + tag(1, 0) + b"\x07"
    assert _agree(data) is not None


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=40))
def test_random_bytes(data: bytes) -> None:
    _agree(data)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.data())
def test_mutated_encodings(msg: pb.AdmitBatch, data: st.DataObject) -> None:
    raw = bytearray(msg.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = data.draw(st.integers(0, len(raw)))
        if how == "flip" and at < len(raw):
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "cut":
            del raw[at:]
        elif how == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=3))
        elif at < len(raw):
            del raw[at]
    _agree(bytes(raw))


def test_reads_a_bytes_like_object(wire: ModuleType) -> None:
    data = pb.AdmitBatch(batch_id=3, tenant_id=["a"]).SerializeToString()
    assert wire.read_batch(memoryview(data)).tenant_id == ["a"]


def test_a_malformed_batch_is_a_value_error(wire: ModuleType) -> None:
    with pytest.raises(ValueError):
        wire.read_batch(b"\x0c")


# ------------------------------------------------------------ writing

bools = st.lists(st.booleans(), max_size=6)


@st.composite
def results(draw: st.DrawFn) -> dict[str, Any]:
    def ints(lo: int, hi: int) -> list[int]:
        small = st.integers(max(lo, -3), min(hi, 300))
        return draw(st.lists(st.one_of(small, st.integers(lo, hi)), max_size=6))

    i32 = (-(2**31), 2**31 - 1)
    fields: dict[str, Any] = {
        "batch_id": draw(st.one_of(st.just(0), st.integers(*U64))),
        "decision": ints(*i32), "reason": ints(*i32), "retry_after_ms": ints(*I64),
        "reserved_tokens": ints(*I64), "reservation_id": ints(*U64),
        "granted_max_tokens": ints(*I64), "bucket_remaining": ints(*I64),
        "hourly_remaining": ints(*I64), "daily_remaining": ints(*I64),
        "duplicate": draw(bools), "shadow_reason": ints(*i32), "degraded": draw(bools),
        "pricing_multiplier": draw(st.sampled_from(["", "1.000000", "2.5é"])),
        "retryable": draw(bools), "queued": draw(bools), "entry": ints(0, 2**32 - 1),
        "queue_wait_ms": ints(*I64), "fallback_model": draw(st.lists(texts, max_size=4)),
        "owner": draw(st.lists(texts, max_size=3)),
        "admission_token": draw(st.lists(st.binary(max_size=5), max_size=3)),
    }  # fmt: skip
    if draw(st.booleans()):
        fields["degradation"] = (
            draw(st.booleans()),
            *[draw(st.one_of(st.integers(-2, 2), i64s)) for _ in "ab"],
            draw(texts),
        )
    if draw(st.booleans()):
        score = st.one_of(st.sampled_from([0.0, -0.0, 1.0, float("nan"), 0.25]), st.floats())
        fields["pressure"] = (
            draw(score),
            draw(st.integers(0, 3)),
            draw(st.integers(0, 2)),
            draw(st.booleans()),
        )
    return fields


def _write(build: ModuleType, f: dict[str, Any]) -> bytes:
    return bytes(build.write_result(
        f["batch_id"], f["decision"], f["reason"], f["retry_after_ms"], f["reserved_tokens"],
        f["reservation_id"], f["granted_max_tokens"], f["bucket_remaining"],
        f["hourly_remaining"], f["daily_remaining"], f["duplicate"], f["shadow_reason"],
        f["degraded"], f.get("degradation"), f.get("pressure"), f["pricing_multiplier"],
        f["retryable"], f["queued"], f["entry"], f["queue_wait_ms"], f["fallback_model"],
        f["owner"], f["admission_token"],
    ))  # fmt: skip


def _serialized(f: dict[str, Any]) -> bytes:
    kw = {k: v for k, v in f.items() if k not in ("degradation", "pressure")}
    msg = pb.AdmitBatchResult(**kw)
    if "degradation" in f:
        active, cap, page, fallback = f["degradation"]
        msg.degradation.CopyFrom(pb.Degradation(
            active=active, max_tokens_cap=cap, page_after_tokens=page, fallback_model=fallback,
        ))  # fmt: skip
    if "pressure" in f:
        score, fresh, stale, shed = f["pressure"]
        msg.pressure.CopyFrom(
            pb.Pressure(score=score, freshness=fresh, stale_policy=stale, shed=shed)
        )
    return msg.SerializeToString()


@settings(max_examples=400, deadline=None)
@given(results())
def test_writes_what_the_runtime_writes(f: dict[str, Any]) -> None:
    want = _serialized(f)
    for build in _builds():
        assert _write(build, f) == want, build.__name__


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reservation_id", [-1]), ("reservation_id", [2**64]), ("entry", [-1]),
        ("entry", [2**32]), ("retry_after_ms", [2**63]), ("decision", [2**31]),
        ("reason", [1.0]), ("batch_id", -1),
        ("admission_token", ["x"]), ("owner", ["\ud800"]),
    ],
)  # fmt: skip
def test_refuses_values_the_runtime_refuses(wire: ModuleType, field: str, value: Any) -> None:
    f = _empty_result()
    f[field] = value
    with pytest.raises(Exception):  # noqa: B017
        _serialized(f)
    with pytest.raises((ValueError, TypeError)):
        _write(wire, f)


def _empty_result() -> dict[str, Any]:
    f: dict[str, Any] = {k: [] for k in (
        "decision", "reason", "retry_after_ms", "reserved_tokens", "reservation_id",
        "granted_max_tokens", "bucket_remaining", "hourly_remaining", "daily_remaining",
        "duplicate", "shadow_reason", "degraded", "retryable", "queued", "entry",
        "queue_wait_ms", "fallback_model", "owner", "admission_token",
    )}  # fmt: skip
    f["batch_id"] = 0
    f["pricing_multiplier"] = ""
    return f


def test_a_large_batch_round_trips(wire: ModuleType) -> None:
    n = 1000
    f = _empty_result()
    f.update(
        batch_id=9, decision=[1, 2] * (n // 2), reason=[0, 1] * (n // 2),
        retry_after_ms=[0, 37] * (n // 2), reserved_tokens=list(range(n)),
        reservation_id=[2**63 + i for i in range(n)], bucket_remaining=[-(10**12)] * n,
        duplicate=[False] * n, degraded=[i % 3 == 0 for i in range(n)],
        fallback_model=["small"] * n, admission_token=[b"t" * 40] * n,
    )  # fmt: skip
    assert _write(wire, f) == _serialized(f)
