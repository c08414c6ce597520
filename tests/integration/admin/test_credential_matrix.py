"""The credential matrix: every kind of credential against every RPC of every
service the server mounts, over real gRPC on PostgreSQL.

Generated, so that the documentation and the server cannot drift apart:

- the expected outcome comes from the role table of docs/operating.md
  ("Keys, roles and where they come from"), parsed here;
- the RPCs come from the server itself: the services its reflection lists
  and their methods from the descriptors it serves.

Each call sends a minimal, valid-ish request; the test asserts only whether
the call got past authentication and authorization (any status but
UNAUTHENTICATED and PERMISSION_DENIED) or was refused with the expected one
of the two. Afterwards nothing has changed: a refused call changes nothing,
and the requests that pass are too empty to change anything either.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from sqlalchemy import update

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.service.signing import AdmissionSigner
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from controlplane.store.models import ApiKey
from tests.conftest import ServerThread
from tests.support import add_tenants

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "operating.md"
HEADER = "| role | services | methods | except |"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
PASSED = "passes"  # any status but the two above
ACTOR = Actor("local:test", "local")
# Inside / outside the scoped sidecar key: tenant A on pool P, tenant B on pool Q.
A, P, B, Q = "acme", "pool-a", "beta", "pool-b"


# ------------------------------------------------------------ the role table


@dataclass(frozen=True)
class Grant:
    services: frozenset[str]
    methods: tuple[str, ...]  # globs
    excepted: frozenset[str]

    def covers(self, service: str, method: str) -> bool:
        """A `Service/Method` entry in the services column grants that one
        method whatever the methods column says (GetCellOwners)."""
        granted = f"{service}/{method}" in self.services or (
            service in self.services and any(fnmatch.fnmatchcase(method, m) for m in self.methods)
        )
        return granted and method not in self.excepted


def role_table(text: str) -> dict[str, Grant]:
    """The role table of docs/operating.md: role -> what it may call."""
    lines = text.splitlines()
    start = lines.index(HEADER)
    assert re.fullmatch(r"\|(---\|){4}", lines[start + 1]), lines[start + 1]
    grants: dict[str, Grant] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4, line
        role, services, methods, excepted = (re.findall(r"`([^`]+)`", c) for c in cells)
        assert len(role) == 1 and services and methods, line
        grants[role[0]] = Grant(frozenset(services), tuple(methods), frozenset(excepted))
    assert set(grants) == {"none", *(r.value for r in Role)}, sorted(grants)
    return grants


def test_the_role_table_parses_as_documented() -> None:
    grants = role_table(DOC.read_text())
    assert grants["viewer"].covers("burstgate.v1.AdminService", "GetTenant")
    assert not grants["viewer"].covers("burstgate.v1.AdminService", "ListApiKeys")
    assert not grants["viewer"].covers("burstgate.v1.LedgerService", "SetPrice")
    assert grants["sidecar"].covers("burstgate.v1.AdmissionService", "Admit")
    assert not grants["admin"].covers("burstgate.v1.AdmissionService", "Admit")
    assert grants["viewer"].covers("burstgate.v1.AdmissionService", "GetCellOwners")


# ------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Credential:
    name: str
    key: str | None  # None: no authorization metadata at all
    role: str | None  # the role that decides, or None: not a usable key
    refusal: str = ""  # what an UNAUTHENTICATED refusal says
    inside: bool = True  # a sidecar call for the key's own tenant and pool
    scheme: str = "Bearer"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.key is None else (("authorization", f"{self.scheme} {self.key}"),)


@dataclass
class Matrix:
    srv: ServerThread
    url: str
    credentials: list[Credential]


@pytest.fixture
def matrix(pg_url: str, make_server: Callable[..., ServerThread]) -> Iterator[Matrix]:
    upgrade(pg_url)
    add_tenants(
        pg_url,
        TenantConfig(A, Decimal(1000), 100_000, pool=P),
        TenantConfig(B, Decimal(1000), 100_000, pool=Q),
    )
    engine = make_engine(pg_url)
    store = KeyStore(engine)

    def key(role: Role, **kw: Any) -> tuple[str, str]:
        secret, info = store.create_key(f"matrix-{role.value}", role, ACTOR, **kw)
        return secret, info.key_id

    admin, _ = key(Role.ADMIN)
    viewer, _ = key(Role.VIEWER)
    scoped, _ = key(Role.SIDECAR, tenants=[A], pools=[P])
    every, _ = key(Role.SIDECAR, tenants=["*"], pools=["*"])
    revoked, revoked_id = key(Role.ADMIN)
    store.revoke_key(revoked_id, ACTOR)
    # Expired: made with a future expiry, then moved into the past in the
    # database (as time would), so the test does not wait.
    expired, expired_id = key(Role.SIDECAR, tenants=["*"], pools=["*"],
                              expires_at=datetime.now(UTC) + timedelta(days=1))  # fmt: skip
    with engine.begin() as conn:
        conn.execute(
            update(ApiKey).where(ApiKey.key_id == expired_id)
            .values(expires_at=datetime.now(UTC) - timedelta(minutes=1))
        )  # fmt: skip
    engine.dispose()
    srv = make_server(pg_url, admission_auth=True, config_poll_s=600)
    wrong_secret = admin[:-4] + ("AAAA" if not admin.endswith("AAAA") else "BBBB")
    yield Matrix(
        srv,
        pg_url,
        [
            Credential("none", None, None, "missing credentials"),
            Credential("not bearer", admin, None, "must be 'Bearer <API key>'", scheme="Basic"),
            Credential("garbage", "hunter2", None, "malformed API key"),
            Credential("wrong secret", wrong_secret, None, "invalid or revoked API key"),
            Credential("revoked", revoked, None, "invalid or revoked API key"),
            Credential("expired", expired, None, "expired API key"),
            Credential("admin", admin, "admin"),
            Credential("viewer", viewer, "viewer"),
            Credential("sidecar A/P for A/P", scoped, "sidecar", inside=True),
            Credential("sidecar A/P for B/Q", scoped, "sidecar", inside=False),
            Credential("sidecar */* for B/Q", every, "sidecar", inside=False),
        ],
    )


# --------------------------------------------------------------- the calls


def mounted_methods(channel: grpc.Channel) -> list[tuple[str, MethodDescriptor]]:
    """(service, method) for every RPC of every service the server lists,
    from the descriptors its reflection serves."""
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    out = []
    for name in db.get_services():
        for method in pool.FindServiceByName(name).methods:
            out.append((name, method))
    return out


def request_id(cred: Credential) -> str:
    return "m-" + re.sub(r"\W", "-", cred.name)


def request_for(
    method: MethodDescriptor, cred: Credential, signer: AdmissionSigner | None = None
) -> Any:
    """A minimal request: empty, except for admission calls, which name the
    tenant and pool the credential acts for (A/P inside its scope, B/Q not).
    Reannounce's entry is signed with ``signer`` (the server's key, as a
    replica of the deployment signs), so that a call past the auth checks
    reaches the restore itself rather than the refusal of an unsigned one."""
    msg: Any = message_factory.GetMessageClass(method.input_type)()
    tenant, pool = (A, P) if cred.inside else (B, Q)
    rid = request_id(cred)
    fields = {f.name for f in method.input_type.fields}
    values: dict[str, Any] = {
        "tenant_id": [tenant] if method.name == "AdmitStream" else tenant,
        "request_id": [rid] if method.name == "AdmitStream" else rid,
        "pool": pool,
        "prompt_tokens": [1] if method.name == "AdmitStream" else 1,
        "max_tokens": [0] if method.name == "AdmitStream" else 0,
        "engine_id": "e1",
        "max_batch_tokens": 10,
        "queue_capacity": 10,
        "list_services": "",  # reflection
    }
    if method.containing_service.full_name == "burstgate.v1.AdmissionService":
        for name, value in values.items():
            if name in fields:
                if isinstance(value, list):
                    getattr(msg, name).extend(value)
                else:
                    setattr(msg, name, value)
        if method.name == "Reannounce":  # one open reservation of that tenant and pool
            token = b"" if signer is None else signer.sign(
                tenant, rid, "", "standard", pool, 1, 0, 0, 1.0, 0, time.time_ns()
            )  # fmt: skip
            msg.reservations.add(
                tenant_id=tenant, request_id=rid, pool=pool, prompt_tokens=1, max_tokens=0,
                reserved_tokens=1, granted_max_tokens=0, admission_token=token,
            )  # fmt: skip
    elif "list_services" in fields:
        msg.list_services = ""
    elif method.name == "SetPrice":
        # An empty SetPrice is a valid wildcard price of 0: made invalid, so
        # that the calls that pass change nothing here either.
        msg.price.input_per_mtok = "not a number"
    elif method.name == "DeletePrice":
        msg.tenant_id = "matrix-none"  # (an empty one deletes the wildcard price)
    return msg


def call(
    channel: grpc.Channel, service: str, method: MethodDescriptor, cred: Credential,
    signer: AdmissionSigner | None = None,
) -> tuple[str, str]:  # fmt: skip
    """The call's status name ("OK" when it passed) and message."""
    path = f"/{service}/{method.name}"
    req = request_for(method, cred, signer)
    ser, de = type(req).SerializeToString, (lambda b: b)
    kw: dict[str, Any] = {"metadata": cred.metadata, "timeout": 10}
    try:
        if method.client_streaming and method.server_streaming:
            stream = channel.stream_stream(path, ser, de)(iter([req]), **kw)
            next(stream, None)
            stream.cancel()
        elif method.client_streaming:
            channel.stream_unary(path, ser, de)(iter([req]), **kw)
        elif method.server_streaming:
            stream = channel.unary_stream(path, ser, de)(req, **kw)
            next(stream, None)  # the first message or the end (Watch never ends)
            stream.cancel()
        else:
            channel.unary_unary(path, ser, de)(req, **kw)
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.CANCELLED:  # our own cancel after the first message
            return "OK", ""
        return str(code.name), str(err.details())
    return "OK", ""


def expected(
    grants: dict[str, Grant], service: str, method: str, cred: Credential
) -> tuple[str, str]:
    """(the outcome, what a refusal's message says)."""
    if grants["none"].covers(service, method):
        return PASSED, ""
    if cred.role is None:
        return UNAUTH.name, cred.refusal
    if not grants[cred.role].covers(service, method):
        return DENIED.name, f"role '{cred.role}' may not call {service}/{method}"
    # A sidecar key acts only for the tenants and pools of its scope.
    if cred.role == "sidecar" and not cred.inside and cred.name.startswith("sidecar A/P"):
        return DENIED.name, "outside this key's"
    return PASSED, ""


def test_credential_matrix(matrix: Matrix) -> None:
    grants = role_table(DOC.read_text())
    channel = grpc.insecure_channel(matrix.srv.target)
    methods = mounted_methods(channel)
    services = {s for s, _ in methods}
    # Every service on the port is in the table (a new one must be documented).
    documented = {s.split("/")[0] for g in grants.values() for s in g.services}
    assert services == documented, (sorted(services), sorted(documented))
    plane = matrix.srv.plane
    audit_before = len(plane.audit_log.list(1000)[0])
    assert plane.metering is not None
    prices_before = plane.metering.store.load_catalog()
    tenants_before = matrix.srv.on_loop(plane.service.views.tenant_ids)
    mismatches = []
    for service, method in methods:
        for cred in matrix.credentials:
            got, details = call(channel, service, method, cred, plane.service.signer)
            got_kind = got if got in (UNAUTH.name, DENIED.name) else PASSED
            want, says = expected(grants, service, method.name, cred)
            if got_kind != want or says not in details:
                mismatches.append((cred.name, f"{service}/{method.name}", want, got, details))
            # A refusal never echoes a key.
            assert not any(c.key and c.key in details for c in matrix.credentials), details
    channel.close()
    cells = len(methods) * len(matrix.credentials)
    assert len(methods) >= 30 and cells >= 300, (len(methods), cells)
    assert mismatches == [], "\n".join(map(str, mismatches))
    # Nothing changed: no audit record, the same tenants; the scoped key
    # decided nothing for B (the key for every tenant did: it may).
    assert len(plane.audit_log.list(1000)[0]) == audit_before
    assert matrix.srv.on_loop(plane.service.views.tenant_ids) == tenants_before
    assert plane.metering.store.load_catalog() == prices_before

    def decided(cred: Credential) -> Any:
        return matrix.srv.on_loop(lambda: plane.service.views.record(B, request_id(cred)))

    by_name = {c.name: c for c in matrix.credentials}
    assert decided(by_name["sidecar A/P for B/Q"]) is None
    assert decided(by_name["sidecar */* for B/Q"]) is not None
