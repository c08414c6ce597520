"""The AdmitStream wire codec, pure-Python reference: ``burstgate.v1.AdmitBatch``
bytes in, as columns; ``burstgate.v1.AdmitBatchResult`` columns out, as bytes.

The compiled twin (``fastpath._wire_c``) gives exactly the same results; both
follow the protobuf runtime (upb) to the byte, which the property tests hold
them to:

- Reading accepts what ``AdmitBatch.FromString`` accepts and refuses what it
  refuses (:class:`WireError`): fields in any order, a singular field given
  several times (the last wins), repeated numbers packed or not (or both),
  unknown fields of every wire type skipped (groups nested up to 100 deep),
  a field with a wire type its declaration does not take read as unknown,
  varints of up to 10 bytes (bits past the 64th dropped), tags of up to 5
  bytes below 2**32 with a field number > 0, lengths of up to 5 bytes, and
  strings that must be valid UTF-8.
- Writing gives the bytes ``AdmitBatchResult.SerializeToString`` gives for
  the same values: fields in number order, repeated numbers packed, empty
  columns and zero/empty singular fields left out, a set submessage written
  even when empty, negative int64/enum values as 10-byte varints.

The message's field numbers are those of proto/burstgate/v1/admission.proto.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence

__all__ = ["AdmitBatchColumns", "WireError", "read_batch", "write_result"]

_MASK64 = (1 << 64) - 1
_MAX_DEPTH = 100  # upb's default nesting limit for the Python runtime
_MAX_SIZE = (1 << 31) - 1


class WireError(ValueError):
    """The bytes are not a valid AdmitBatch."""


class AdmitBatchColumns:
    """One AdmitBatch as columns, named as the message's fields. Equal
    ``tenant_id`` (and ``lane``) entries are one and the same ``str``."""

    __slots__ = (
        "attempt", "batch_id", "lane", "max_tokens", "max_wait_ms", "model", "pool",
        "prompt_tokens", "request_id", "retry_key", "tenant_id",
    )  # fmt: skip

    def __init__(self) -> None:
        self.batch_id = 0
        self.tenant_id: list[str] = []
        self.request_id: list[str] = []
        self.lane: list[str] = []
        self.prompt_tokens: list[int] = []
        self.max_tokens: list[int] = []
        self.model = ""
        self.pool = ""
        self.max_wait_ms: list[int] = []
        self.retry_key: list[str] = []
        self.attempt: list[int] = []


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A varint of at most 10 bytes, bits past the 64th dropped."""
    value = 0
    shift = 0
    while True:
        if pos >= end or shift >= 70:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _MASK64, pos
        shift += 7


def _small_varint(data: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    """A tag or a length: at most 5 bytes."""
    value = 0
    for i in range(5):
        if pos >= end:
            raise WireError(f"truncated {what}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value, pos
    raise WireError(f"overlong {what}")


def _tag(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    tag, pos = _small_varint(data, pos, end, "tag")
    if tag >> 32 or tag >> 3 == 0:
        raise WireError("bad tag")
    return tag >> 3, tag & 7, pos


def _length(data: bytes, pos: int, end: int) -> tuple[int, int]:
    size, pos = _small_varint(data, pos, end, "length")
    if size >= _MAX_SIZE or size > end - pos:
        raise WireError("length past the end")
    return pos + size, pos


def _skip(data: bytes, pos: int, end: int, field: int, wire: int, depth: int) -> int:
    """Past an unknown field whose tag was just read."""
    if wire == 0:
        return _varint(data, pos, end)[1]
    if wire == 1 or wire == 5:
        pos += 8 if wire == 1 else 4
        if pos > end:
            raise WireError("truncated fixed-size field")
        return pos
    if wire == 2:
        return _length(data, pos, end)[0]
    if wire == 3:
        if depth >= _MAX_DEPTH:
            raise WireError("groups nested too deep")
        while True:
            inner, inner_wire, pos = _tag(data, pos, end)
            if inner_wire == 4:
                if inner != field:
                    raise WireError("mismatched end group")
                return pos
            pos = _skip(data, pos, end, inner, inner_wire, depth + 1)
    raise WireError("unexpected end group" if wire == 4 else "bad wire type")


def _text(data: bytes, start: int, stop: int) -> str:
    try:
        return data[start:stop].decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("string field is not valid UTF-8") from None


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


_STRINGS = {2: "tenant_id", 3: "request_id", 4: "lane", 10: "retry_key"}
_INTS = {5: "prompt_tokens", 6: "max_tokens", 9: "max_wait_ms", 11: "attempt"}


def read_batch(data: bytes) -> AdmitBatchColumns:
    """An AdmitBatch's wire bytes as columns; :class:`WireError` when the
    protobuf runtime would refuse them."""
    if type(data) is not bytes:
        data = bytes(data)
    out = AdmitBatchColumns()
    interned: dict[str, str] = {}
    end = len(data)
    pos = 0
    while pos < end:
        field, wire, pos = _tag(data, pos, end)
        if field in _STRINGS and wire == 2:
            stop, pos = _length(data, pos, end)
            text = _text(data, pos, stop)
            pos = stop
            if field == 2 or field == 4:
                text = interned.setdefault(text, text)
            getattr(out, _STRINGS[field]).append(text)
        elif field in _INTS and wire in (0, 2):
            column: list[int] = getattr(out, _INTS[field])
            if wire == 0:
                value, pos = _varint(data, pos, end)
                column.append(value & 0xFFFFFFFF if field == 11 else _signed(value))
                continue
            stop, pos = _length(data, pos, end)
            while pos < stop:
                value, pos = _varint(data, pos, stop)
                column.append(value & 0xFFFFFFFF if field == 11 else _signed(value))
        elif field == 1 and wire == 0:
            out.batch_id, pos = _varint(data, pos, end)
        elif (field == 7 or field == 8) and wire == 2:
            stop, pos = _length(data, pos, end)
            text = _text(data, pos, stop)
            pos = stop
            if field == 7:
                out.model = text
            else:
                out.pool = text
        else:
            pos = _skip(data, pos, end, field, wire, 0)
    return out


# ------------------------------------------------------------------ writing


def _put_varint(out: bytearray, value: int) -> None:
    value &= _MASK64
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_tag(out: bytearray, field: int, wire: int) -> None:
    _put_varint(out, field << 3 | wire)


def _int_value(value: object, lo: int, hi: int) -> int:
    """As the runtime takes an integer field's value: an integer (not a
    float), in range."""
    if isinstance(value, float):
        raise TypeError(f"an integer is required, got {value!r}")
    number = operator.index(value)  # type: ignore[arg-type]
    if not lo <= number <= hi:
        raise ValueError(f"value out of range: {number}")
    return int(number)


_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64 = (0, _MASK64)
_INT32 = (-(1 << 31), (1 << 31) - 1)
_UINT32 = (0, (1 << 32) - 1)


def _packed(out: bytearray, field: int, values: Sequence[object], lo: int, hi: int) -> None:
    if not len(values):
        return
    body = bytearray()
    for v in values:
        _put_varint(body, _int_value(v, lo, hi))
    _put_tag(out, field, 2)
    _put_varint(out, len(body))
    out += body


def _packed_bool(out: bytearray, field: int, values: Sequence[object]) -> None:
    if not len(values):
        return
    _put_tag(out, field, 2)
    _put_varint(out, len(values))
    out += bytes(1 if v else 0 for v in values)


def _utf8(value: object) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"a str is required, got {type(value).__name__}")
    return value.encode("utf-8")


def _strings(out: bytearray, field: int, values: Sequence[object], raw: bool = False) -> None:
    for v in values:
        if raw:
            if not isinstance(v, bytes):
                raise TypeError(f"bytes are required, got {type(v).__name__}")
            b = v
        else:
            b = _utf8(v)
        _put_tag(out, field, 2)
        _put_varint(out, len(b))
        out += b


def _submessage(out: bytearray, field: int, body: bytearray) -> None:
    _put_tag(out, field, 2)
    _put_varint(out, len(body))
    out += body


def write_result(
    batch_id: int,
    decision: Sequence[int],
    reason: Sequence[int],
    retry_after_ms: Sequence[int],
    reserved_tokens: Sequence[int],
    reservation_id: Sequence[int],
    granted_max_tokens: Sequence[int],
    bucket_remaining: Sequence[int],
    hourly_remaining: Sequence[int],
    daily_remaining: Sequence[int],
    duplicate: Sequence[bool],
    shadow_reason: Sequence[int],
    degraded: Sequence[bool],
    degradation: tuple[bool, int, int, str] | None,
    pressure: tuple[float, int, int, bool] | None,
    pricing_multiplier: str,
    retryable: Sequence[bool],
    queued: Sequence[bool],
    entry: Sequence[int],
    queue_wait_ms: Sequence[int],
    fallback_model: Sequence[str],
    owner: Sequence[str],
    admission_token: Sequence[bytes],
) -> bytes:
    """An AdmitBatchResult's wire bytes, as ``SerializeToString`` writes the
    message with these fields. ``degradation``: (active, max_tokens_cap,
    page_after_tokens, fallback_model) or None (not set); ``pressure``:
    (score, freshness, stale_policy, shed) or None."""
    out = bytearray()
    batch = _int_value(batch_id, *_UINT64)
    if batch:
        _put_tag(out, 1, 0)
        _put_varint(out, batch)
    _packed(out, 2, decision, *_INT32)
    _packed(out, 3, reason, *_INT32)
    _packed(out, 4, retry_after_ms, *_INT64)
    _packed(out, 5, reserved_tokens, *_INT64)
    _packed(out, 6, reservation_id, *_UINT64)
    _packed(out, 7, granted_max_tokens, *_INT64)
    _packed(out, 8, bucket_remaining, *_INT64)
    _packed(out, 9, hourly_remaining, *_INT64)
    _packed(out, 10, daily_remaining, *_INT64)
    _packed_bool(out, 11, duplicate)
    _packed(out, 12, shadow_reason, *_INT32)
    _packed_bool(out, 13, degraded)
    if degradation is not None:
        active, cap, page, fallback = degradation
        body = bytearray()
        if active:
            body += b"\x08\x01"
        for number, value in ((2, cap), (3, page)):
            v = _int_value(value, *_INT64)
            if v:
                _put_tag(body, number, 0)
                _put_varint(body, v)
        text = _utf8(fallback)
        if text:
            _strings(body, 4, [fallback])
        _submessage(out, 14, body)
    if pressure is not None:
        score, freshness, stale_policy, shed = pressure
        body = bytearray()
        bits = struct.pack("<d", float(score))
        if bits != bytes(8):  # -0.0 is written: only all-zero bits are the default
            body.append(0x09)
            body += bits
        fresh = _int_value(freshness, *_INT32)
        if fresh:
            body.append(0x10)
            _put_varint(body, fresh)
        if shed:
            body += b"\x20\x01"
        stale = _int_value(stale_policy, *_INT32)
        if stale:
            body.append(0x28)
            _put_varint(body, stale)
        _submessage(out, 15, body)
    _packed_bool(out, 21, retryable)
    text = _utf8(pricing_multiplier)
    if text:
        _strings(out, 22, [pricing_multiplier])
    _packed_bool(out, 23, queued)
    _packed(out, 24, entry, *_UINT32)
    _packed(out, 25, queue_wait_ms, *_INT64)
    _strings(out, 26, fallback_model)
    _strings(out, 27, owner)
    _strings(out, 28, admission_token, raw=True)
    return bytes(out)
