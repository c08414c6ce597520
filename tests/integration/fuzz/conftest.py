"""The fuzzed server and what the fuzz checks against it.

One real server (gRPC on a free port, PostgreSQL, admission auth on) for
the whole module: a fresh database per example would cost seconds each.
Every RPC of every burstgate service is found in the proto descriptors
(``RPCS``), called generically (``call``) with an admin key, or a sidecar
key for AdmissionService, and judged (``Judge``): a status from the
documented set, no long input echoed back, and, when the call was refused
or only reads, the same state after it as before (``Snapshot``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import grpc
import psycopg
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admission_pb2, ledger_pb2
from google.protobuf.descriptor import (
    Descriptor,
    FieldDescriptor,
    MethodDescriptor,
    ServiceDescriptor,
)
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from sqlalchemy import Engine, select
from sqlalchemy.engine import make_url

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2
from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from controlplane.rpc.errors import DOMAIN
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.models import Base
from tests.conftest import ServerThread
from tests.integration.admin.conftest import Keys, make_keys, start_server
from tests.support import error_details

# The services the server mounts (besides health and reflection, which take
# no input worth fuzzing); test_fuzz_rpc checks this against reflection.
# Envoy's rate-limit service is mounted when the server has an Envoy mapping
# (the fuzzed server has deploy/envoy's): it is an admission door too.
SERVICE_MODULES = (admission_pb2, apb, ledger_pb2, rls_pb2)
SERVICES: tuple[ServiceDescriptor, ...] = tuple(
    s for m in SERVICE_MODULES for s in m.DESCRIPTOR.services_by_name.values()
)
RPCS: tuple[tuple[ServiceDescriptor, MethodDescriptor], ...] = tuple(
    (s, m) for s in SERVICES for m in s.methods
)
ADMISSION = "burstgate.v1.AdmissionService"
ENVOY_RLS = "envoy.service.ratelimit.v3.RateLimitService"
REJECT = admission_pb2.DECISION_REJECT
# The doors a sidecar key opens (the rest take an admin key).
SIDECAR_SERVICES = frozenset({ADMISSION, ENVOY_RLS})
ENVOY_MAPPING = Path(__file__).parents[3] / "deploy" / "envoy" / "burstgate-envoy.yaml"

# Statuses a call may answer (docs/api.md "Errors", the protos' status lists).
# UNAUTHENTICATED is not among them: every call carries a valid key.
# RESOURCE_EXHAUSTED is documented only for a message over the server's
# size limit, which the fuzz never sends; UNAVAILABLE only while the
# database is unreachable, which it is not here.
DOCUMENTED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # Settings.max_message_bytes' default

# Methods that change state when they succeed; any other method must leave
# the state as it was even when it answers OK (a read). The rule is by name
# so that a new method that is not a write is held to "no change".
WRITE_PREFIXES = ("Create", "Update", "Delete", "Disable", "Enable", "Revoke", "Set")
ADMISSION_WRITES = frozenset({"Admit", "AdmitStream", "Complete", "ReportLoad"})

# Tables written by the server's background loops, not by calls (a pricing
# window closes on the clock), and columns that record use rather than state.
# The scale-out tables are coordination, not state a call may corrupt: the
# member's heartbeat and its lease renewals change them every tick, and the
# first request naming a pool claims that pool's cell (routing comes before
# the rest of the request is validated, as in a gateway); docs/ha.md.
UNSNAPSHOTTED_TABLES = frozenset({
    "pricing_windows", "margin_warnings", "ha_members", "ha_cell_leases",
    "ha_tenant_anchors", "ha_tenant_rates", "ha_tenant_quotas",
})  # fmt: skip
UNSNAPSHOTTED_COLUMN_PARTS = ("last_used",)

TENANTS = ("acme", "beta")
# The API's own words the strings are drawn from besides hostile ones: ids
# that exist, so that validation passes and the code behind it runs.
DOMAIN_WORDS = (
    *TENANTS, "gamma", "r1", "r2", "r3", "standard", "premium", "batch", "default", "gpu-a",
    "px", "e", "llama-3.1-70b", "*", "USD", "EUR", "admin", "viewer", "sidecar",
    "tenant:acme", "policy", "tenant.create", "tenant.update", "policy.update",
    # The Envoy mapping's descriptor keys and values (deploy/envoy).
    "burstgate", "tenant", "lane", "request_id", "phase", "response", "prompt_tokens",
    "completion_tokens", "usage", "reported", "missing", "none", "retry_key", "attempt",
    *Policy.model_fields,
)  # fmt: skip
CALL_TIMEOUT_S = 10.0
LONG_ECHO = 200  # an input string this long must never come back whole


def is_write(service: ServiceDescriptor, method: MethodDescriptor) -> bool:
    if service.full_name == ADMISSION:
        return method.name in ADMISSION_WRITES
    if service.full_name == ENVOY_RLS:
        return True  # ShouldRateLimit admits (request path) or settles (response path)
    return method.name.startswith(WRITE_PREFIXES)


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[Message]
    error: grpc.RpcError | None = None


def call(
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    requests: Sequence[Message | bytes],
    metadata: tuple[tuple[str, str], ...],
) -> Outcome:
    """Call ``method`` with ``requests`` (one, or the stream's messages);
    raw ``bytes`` are sent as they are (malformed protobuf)."""
    path = f"/{service.full_name}/{method.name}"

    def ser(m: Message | bytes) -> bytes:
        return m if isinstance(m, bytes) else m.SerializeToString()

    de = GetMessageClass(method.output_type).FromString
    kw: dict[str, Any] = {"timeout": CALL_TIMEOUT_S, "metadata": metadata}
    out: list[Message] = []  # a stream's answers before an error stand
    try:
        if method.client_streaming and method.server_streaming:
            out.extend(channel.stream_stream(path, ser, de)(iter(requests), **kw))
        elif method.server_streaming:
            out.extend(channel.unary_stream(path, ser, de)(requests[0], **kw))
        elif method.client_streaming:
            out.append(channel.stream_unary(path, ser, de)(iter(requests), **kw))
        else:
            out.append(channel.unary_unary(path, ser, de)(requests[0], **kw))
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", out, exc)
    return Outcome(grpc.StatusCode.OK, "", out)


@dataclass
class Snapshot:
    """Everything a call could change: every table (less the background
    ones) and the serving process's live state that the admin API shows."""

    tables: dict[str, list[tuple[Any, ...]]]
    live: dict[str, Any]

    def diff(self, after: Snapshot) -> list[str]:
        out = [
            f"table {name}: {len(rows)} rows -> {len(after.tables[name])} rows"
            + (" (contents changed)" if len(rows) == len(after.tables[name]) else "")
            for name, rows in self.tables.items()
            if after.tables[name] != rows
        ]
        out += [
            f"{key}: {value!r} -> {after.live.get(key)!r}"
            for key, value in self.live.items()
            if after.live.get(key) != value
        ]
        return out

    def changed_besides_audit(self, after: Snapshot) -> bool:
        return any(
            after.tables[n] != rows for n, rows in self.tables.items() if n != "audit_events"
        ) or any(after.live.get(k) != v for k, v in self.live.items())


@dataclass
class Fuzzed:
    url: str
    srv: ServerThread
    keys: Keys
    channel: grpc.Channel
    engine: Engine
    last: Snapshot | None = None  # the state after the previous call, when taken

    def metadata(self, service: ServiceDescriptor) -> tuple[tuple[str, str], ...]:
        key = self.keys.sidecar if service.full_name in SIDECAR_SERVICES else self.keys.admin
        return (("authorization", f"Bearer {key}"),)

    def snapshot(self) -> Snapshot:
        tables: dict[str, list[tuple[Any, ...]]] = {}
        with self.engine.connect() as c:
            for t in Base.metadata.sorted_tables:
                if t.name in UNSNAPSHOTTED_TABLES:
                    continue
                cols = [
                    col
                    for col in t.columns
                    if not any(p in col.name for p in UNSNAPSHOTTED_COLUMN_PARTS)
                ]
                tables[t.name] = sorted((tuple(r) for r in c.execute(select(*cols))), key=repr)
        # The live state, through the admin API as an operator sees it.
        md = (("authorization", f"Bearer {self.keys.admin}"),)
        state = self.channel.unary_unary(
            "/burstgate.v1.AdminService/GetServerState",
            apb.GetServerStateRequest.SerializeToString,
            apb.ServerState.FromString,
        )(apb.GetServerStateRequest(), timeout=CALL_TIMEOUT_S, metadata=md)
        live: dict[str, Any] = {
            "open_reservations": state.open_reservations,
            "tenants": state.tenants,
            "pools": sorted(p.pool for p in state.pools),
        }
        get_state = self.channel.unary_unary(
            "/burstgate.v1.AdminService/GetTenantState",
            apb.GetTenantStateRequest.SerializeToString,
            apb.TenantState.FromString,
        )
        for tenant in TENANTS:
            try:
                ts = get_state(
                    apb.GetTenantStateRequest(tenant_id=tenant),
                    timeout=CALL_TIMEOUT_S,
                    metadata=md,
                )
            except grpc.RpcError as exc:
                live[f"tenant {tenant}"] = exc.code().name
                continue
            live[f"tenant {tenant}"] = (
                ts.enabled, ts.in_flight_requests, ts.in_flight_tokens, ts.queued_requests,
                ts.hourly_used_tokens, ts.daily_used_tokens,
            )  # fmt: skip
        return Snapshot(tables, live)


def long_strings(msg: Message) -> set[str]:
    """The strings of ``LONG_ECHO`` characters or more anywhere in ``msg``."""
    found: set[str] = set()
    for f, value in msg.ListFields():
        values = value.items() if isinstance(value, dict) or hasattr(value, "items") else None
        items: list[Any]
        if values is not None:
            items = [x for kv in values for x in kv]
        elif f.is_repeated:
            items = list(value)
        else:
            items = [value]
        for v in items:
            if isinstance(v, str) and len(v) >= LONG_ECHO:
                found.add(v)
            elif isinstance(v, Message):
                found |= long_strings(v)
    return found


def judge(
    fz: Fuzzed,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    requests: Sequence[Message | bytes],
    metadata: tuple[tuple[str, str], ...] | None = None,
    expect: frozenset[grpc.StatusCode] | None = None,
) -> Outcome:
    """Call and check; an AssertionError says what was wrong. ``expect``:
    the statuses this call may answer (default: ``DOCUMENTED``)."""
    before = fz.last or fz.snapshot()
    fz.last = None  # set again only if this call passes every check
    out = call(fz.channel, service, method, requests, metadata or fz.metadata(service))
    size = max((len(r) if isinstance(r, bytes) else r.ByteSize()) for r in requests)
    name = f"{service.name}.{method.name}"
    allowed = expect if expect is not None else DOCUMENTED
    oversize = out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and size > MAX_MESSAGE_BYTES
    assert out.code in allowed or oversize, (
        f"{name} answered {out.code.name}: {out.details[:300]!r}"
    )
    assert len(out.details) <= 2000, f"{name}: a {len(out.details)}-character status message"
    for s in (x for r in requests if isinstance(r, Message) for x in long_strings(r)):
        assert s not in out.details, f"{name} echoed a {len(s)}-character input back"
    if out.error is not None and not oversize:
        # Every error burstgate answers is structured (docs/api.md, "Errors"): a
        # google.rpc.Status with the call's code and message, an ErrorInfo,
        # a BadRequest naming the field on INVALID_ARGUMENT, a RetryInfo on
        # UNAVAILABLE. (An oversize message is refused by gRPC itself.)
        d = error_details(out.error)
        assert d.info.reason and d.info.domain == DOMAIN, f"{name}: {d.info}"
        if out.code == grpc.StatusCode.INVALID_ARGUMENT:
            assert d.bad_request is not None, f"{name}: INVALID_ARGUMENT without BadRequest"
            [violation] = d.bad_request.field_violations
            assert out.details.removeprefix(_prefix(out.details)).startswith(violation.field)
        if out.code == grpc.StatusCode.UNAVAILABLE:
            assert d.retry is not None, f"{name}: UNAVAILABLE without RetryInfo"
    if out.code == grpc.StatusCode.INVALID_ARGUMENT:
        messages = [r for r in requests if isinstance(r, Message)]
        assert not messages or names_a_field(out.details, messages), (
            f"{name}: INVALID_ARGUMENT not naming a field: {out.details[:200]!r}"
        )
    after: Snapshot | None = None
    if not may_change_state(service, method, out):
        after = fz.snapshot()
        diff = before.diff(after)
        assert not diff, f"{name} answered {out.code.name} and changed state: {diff}"
    elif service.full_name not in SIDECAR_SERVICES:
        after = fz.snapshot()
        # Every change through an admin-capable call is audited (admin.proto).
        if before.changed_besides_audit(after):
            assert len(after.tables["audit_events"]) > len(before.tables["audit_events"]), (
                f"{name} changed state with no audit record: {before.diff(after)}"
            )
    fz.last = after  # the next call's "before", when nothing else ran since
    return out


_BATCH = re.compile(r"^batch \d+: ")


def _prefix(details: str) -> str:
    """``batch N: `` when a stream's message starts with it, else ''."""
    m = _BATCH.match(details)
    return m.group(0) if m else ""


def names_a_field(details: str, requests: list[Message]) -> bool:
    """The status message starts with a field's name (``name:`` or
    ``name[i]:``, after ``batch N: `` in a stream): a field of the request
    messages (at any depth), or a name the request gives as data, a map key
    or an entry of a repeated string (UpdatePolicy names the policy key, in
    ``set`` or ``reset``; admin.proto)."""
    rest = _BATCH.sub("", details, count=1)
    desc = cast("Descriptor", requests[0].DESCRIPTOR)  # upb's type is the same API
    names = _field_names(desc).union(*(n for r in requests for n in _names_as_data(r)))
    # A well-known type's field keeps its path: update_mask.paths[0].
    names |= {f"{a}.{b}" for a in names for b in ("paths",)}
    return any(rest.startswith((f"{n}:", f"{n}[")) for n in names)


def _field_names(desc: Descriptor, seen: frozenset[str] = frozenset()) -> set[str]:
    names = {f.name for f in desc.fields}
    for f in desc.fields:
        if f.message_type is not None and f.message_type.full_name not in seen:
            names |= _field_names(f.message_type, seen | {desc.full_name})
    return names


def _names_as_data(msg: Message) -> Iterator[set[str]]:
    for f, value in msg.ListFields():
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            yield {str(k) for k in value}
        elif f.message_type is not None:
            for v in value if f.is_repeated else [value]:
                yield from _names_as_data(v)
        elif f.is_repeated and f.type == FieldDescriptor.TYPE_STRING:
            yield set(value)


def may_change_state(service: ServiceDescriptor, method: MethodDescriptor, out: Outcome) -> bool:
    """A write that succeeded, except an admission answered only with
    refusals (a refusal reserves nothing); and a stream ended by an error
    after answers that admitted (those batches stand)."""
    decisions: list[int] | None = []
    for r in out.responses:
        if isinstance(r, admission_pb2.AdmitResponse) and decisions is not None:
            decisions.append(r.decision)
        elif isinstance(r, admission_pb2.AdmitBatchResult) and decisions is not None:
            decisions.extend(r.decision)
        elif isinstance(r, rls_pb2.RateLimitResponse) and decisions is not None:
            # OVER_LIMIT is a refusal (or bad input named in x-burstgate-error)
            # and must change nothing; OK admitted, settled, or only checked.
            over = r.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT
            decisions.append(REJECT if over else admission_pb2.DECISION_ADMIT)
        else:
            decisions = None  # not an admission answer
    admitted = decisions is not None and admission_pb2.DECISION_ADMIT in decisions
    if out.code != grpc.StatusCode.OK:
        return admitted
    return is_write(service, method) and (decisions is None or not out.responses or admitted)


@pytest.fixture(scope="module")
def fuzzed(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    """Two tenants that never wait in a queue (a fuzzed Admit answers at
    once), the pool gate off (no fallback concurrency to wait for), keys of
    every role, and a server with admission auth on."""
    name = f"burstgate_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(pg_admin_dsn).set(database=name).render_as_string(hide_password=False)
    engine: Engine | None = None
    srv: ServerThread | None = None
    try:
        upgrade(url)
        engine = make_engine(url)
        repo = ConfigRepository(engine)
        for t in TENANTS:
            repo.add_tenant(TenantConfig(t, Decimal(1_000_000), 10**9, max_wait_ms=0))
        repo.update_policy(Policy(), {"pool_gate": False}, [])
        keys = make_keys(url)
        spool: Path = tmp_path_factory.mktemp("spool")
        srv = start_server(url, admission_auth=True, ledger_spool_dir=spool,
                           envoy_rls_config=ENVOY_MAPPING)  # fmt: skip
        with grpc.insecure_channel(srv.target) as channel:
            yield Fuzzed(url, srv, keys, channel, engine)
    finally:
        if srv is not None:
            srv.stop()
        if engine is not None:
            engine.dispose()
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
