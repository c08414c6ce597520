"""Hypothesis strategies for any protobuf message, built from its descriptor.

Nothing here knows a burstgate message: every field gets values by its
type, so a new field or RPC is fuzzed without a change here, and a field
type this module does not know raises ``NoStrategy`` (the fuzz test fails
instead of skipping it). The values lean on what breaks servers: strings
empty, 10,000 characters, with NULs, right-to-left marks and astral
characters, or one of the API's own words (tenant ids, lane and pool
names, policy keys, field names, JSON literals) so that validation is
passed and the code behind it is reached; integers at the int32 / int64 /
uint64 bounds, negative, around the API's documented limits (10^7 tokens,
10^12 counts, 2^53) and Unix-nanosecond times; floats NaN, +-inf, -0.0,
subnormal, just outside [0, 1]; enum values unknown to the schema; repeated
fields empty, short, or with hundreds of entries; maps; nested messages
(to a bounded depth); proto3 ``optional`` fields present or absent.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

# Sizes are kept well under the server's 4 MiB message limit: RESOURCE_EXHAUSTED
# for an oversized message is documented, and not what this fuzz is after.
HUGE = 10_000
MANY = 300
MAX_DEPTH = 3

NOW_NS = 1_800_000_000_000_000_000  # about 2027: a plausible *_unix_ns
INT64_EDGES = (
    0, 1, -1, -5, 2, 100, 10**7, 10**7 + 1, 10**12, 10**12 + 1, 2**31 - 1, -(2**31), 2**32,
    2**53, 2**53 + 1, NOW_NS, -NOW_NS, 2**62, 2**63 - 1, -(2**63), -(2**63) + 1,
)  # fmt: skip
INT32_EDGES = (0, 1, -1, 2, 100, 1000, 1001, 2**31 - 1, -(2**31))
UINT64_EDGES = (0, 1, 2, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
UINT32_EDGES = (0, 1, 2, 2**31, 2**32 - 1)
FLOAT_EDGES = (
    math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, 1.0, -1.0, 1.0000001, -1e-9, 5e-324,
    1.7976931348623157e308, -1.7976931348623157e308, 1e15,
)  # fmt: skip
HOSTILE_STRINGS = (
    "", " ", "x" * HUGE, "l" * 129, "l" * 257, "\x00", "acme\x00", "\x00" * 64, "\n",
    "\r\nx-evil: 1", "é", "名前", "\U0001f642" * 40, "\u202eacme", "\ufeff", "\u0085",
    "'; DROP TABLE tenants; --", "%s%n%x", "${jndi:ldap://x/a}", "../../etc/passwd",
    "\\", '"', "*", "%", "_", "acme ", " acme", "ACME",
)  # fmt: skip
JSON_VALUES = (
    "true", "false", "null", "0", "1", "-1", "0.5", "1.5", "1e400", "NaN", "Infinity",
    "2147483648", "9223372036854775808", '"true"', '"1"', '"fail_open"', '"fail_closed"',
    "[]", "{}", '["gpu-a"]', '[""]', '{"a": 1}', "", "tru", "'1'",
)  # fmt: skip


def vocabulary(domain_words: Iterable[str], descriptors: Iterable[Descriptor]) -> list[str]:
    """The API's own words: ``domain_words`` (ids in the test database, policy
    keys, ...) and every field name of ``descriptors`` and the messages they
    reach (FieldMask paths, map keys), with JSON literals."""
    words = set(domain_words) | set(JSON_VALUES)
    seen: set[str] = set()

    def walk(d: Descriptor) -> None:
        if d.full_name in seen:
            return
        seen.add(d.full_name)
        for f in d.fields:
            words.add(f.name)
            if f.message_type is not None:
                walk(f.message_type)

    for d in descriptors:
        walk(d)
    return sorted(words)


class NoStrategy(TypeError):
    """A field type the fuzz has no values for."""


class MessageStrategies:
    """``for_message(descriptor)``: a strategy of messages of that type."""

    def __init__(self, vocab: list[str]) -> None:
        self.text = st.one_of(
            st.sampled_from(vocab),
            st.sampled_from(HOSTILE_STRINGS),
            st.text(max_size=40),
            st.text(alphabet=st.characters(codec="utf-8"), min_size=129, max_size=400),
        )
        self.scalars: dict[int, st.SearchStrategy[Any]] = {
            FieldDescriptor.TYPE_STRING: self.text,
            FieldDescriptor.TYPE_BYTES: st.one_of(
                st.binary(max_size=64), st.just(b"\xff" * HUGE), st.just(b"")
            ),
            FieldDescriptor.TYPE_BOOL: st.booleans(),
            FieldDescriptor.TYPE_DOUBLE: _floats(64),
            FieldDescriptor.TYPE_FLOAT: _floats(32),
        }
        for types, edges, lo, hi in (
            ((FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
              FieldDescriptor.TYPE_SFIXED64), INT64_EDGES, -(2**63), 2**63 - 1),
            ((FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
              FieldDescriptor.TYPE_SFIXED32), INT32_EDGES, -(2**31), 2**31 - 1),
            ((FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64), UINT64_EDGES, 0,
             2**64 - 1),
            ((FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32), UINT32_EDGES, 0,
             2**32 - 1),
        ):  # fmt: skip
            ints = st.one_of(st.sampled_from(edges), st.integers(0, 1000), st.integers(lo, hi))
            for t in types:
                self.scalars[t] = ints
        self._cache: dict[tuple[str, int], st.SearchStrategy[Message]] = {}

    def for_message(self, desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
        key = (desc.full_name, depth)
        if key not in self._cache:
            cls = GetMessageClass(desc)
            if depth >= MAX_DEPTH:
                self._cache[key] = st.builds(cls)
            else:
                fields = {f.name: self._field(f, depth) for f in desc.fields}
                self._cache[key] = st.fixed_dictionaries({}, optional=fields).map(
                    functools.partial(_build, desc, cls)
                )
        return self._cache[key]

    def _single(self, f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            return self.for_message(_message(f), depth + 1)
        if f.type == FieldDescriptor.TYPE_ENUM:
            assert f.enum_type is not None
            known = [v.number for v in f.enum_type.values]
            # Unknown values too: proto3 enums are open, any int32 arrives.
            return st.one_of(st.sampled_from(known), st.sampled_from((-1, 99, 2**31 - 1)))
        if f.type in self.scalars:
            return self.scalars[f.type]
        raise NoStrategy(f"{f.full_name}: no strategy for field type {f.type}")

    def _field(self, f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        if _is_map(f):
            key_f = _message(f).fields_by_name["key"]
            value_f = _message(f).fields_by_name["value"]
            keys, values = self._single(key_f, depth), self._single(value_f, depth)
            return st.one_of(
                st.dictionaries(keys, values, max_size=4),
                st.dictionaries(keys, values, min_size=MANY // 3, max_size=MANY // 3 + 1),
            )
        one = self._single(f, depth)
        if f.is_repeated:
            return st.one_of(
                st.lists(one, max_size=4),
                # Many entries, all alike (distinct ones would cost the
                # generator more than the server).
                one.flatmap(lambda v: st.integers(MANY // 2, MANY).map(lambda n: [v] * n)),
            )
        return one


def _floats(width: int) -> st.SearchStrategy[float]:
    edges = [x for x in FLOAT_EDGES if width == 64 or abs(x) < 3.4e38 or not math.isfinite(x)]
    return st.one_of(st.sampled_from(edges), st.floats(width=width), st.floats(0, 1))  # type: ignore[arg-type]


def _is_map(f: FieldDescriptor) -> bool:
    return (
        f.type == FieldDescriptor.TYPE_MESSAGE
        and f.is_repeated
        and _message(f).GetOptions().map_entry
    )


def _message(f: FieldDescriptor) -> Descriptor:
    assert f.message_type is not None, f.full_name
    return f.message_type


def _build(desc: Descriptor, cls: Any, values: dict[str, Any]) -> Message:
    msg: Message = cls()
    for name, value in values.items():
        f = desc.fields_by_name[name]
        target = getattr(msg, name)
        if _is_map(f):
            if _message(f).fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for k, v in value.items():
                    target[k].CopyFrom(v)
            else:
                target.update(value)
        elif f.is_repeated:
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg
