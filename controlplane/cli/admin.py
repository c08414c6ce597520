"""``burstgate admin ...`` (the admin API over gRPC) and ``burstgate keys ...``
(API keys, DB-direct: the bootstrap path).

``admin`` commands talk to a running server: ``--target`` /
``BURSTGATE_ADMIN_TARGET`` (default 127.0.0.1:50051) and ``--api-key`` /
``BURSTGATE_API_KEY``; TLS with ``--tls-ca`` (and ``--tls-cert``/``--tls-key``
for mTLS). Every change goes through the server: validated, audited and live
before the command returns. ``keys`` commands write the database directly,
so the first admin key can be created before anyone can authenticate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from controlplane.cli.common import (
    DEFAULT_ADMIN_TARGET,
    UNLIMITED,
    ApiKeyOpt,
    JsonOpt,
    TimeoutOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TlsNameOpt,
    admin_client,
    cell,
    connection,
    echo_json,
    fail,
    kv,
    parse_limit,
    table,
    to_dict,
)
from controlplane.cli.render import TIME_FORMAT
from controlplane.domain.errors import excerpt
from controlplane.domain.keys import Role

ADMIN_HELP = """Operate a running server through the admin API (gRPC, needs an API key).

Connection: --target / BURSTGATE_ADMIN_TARGET, --api-key / BURSTGATE_API_KEY
(create one with `burstgate keys create --role admin`). Changes are
validated, audited and live before the command returns."""

admin_app = typer.Typer(help=ADMIN_HELP, no_args_is_help=True)
lane_app = typer.Typer(help="Priority lanes: weights and wait targets.", no_args_is_help=True)
policy_app = typer.Typer(
    help="Burst-shaping policy (backpressure, degradation, queues).", no_args_is_help=True
)
audit_app = typer.Typer(help="The audit log of changes.", no_args_is_help=True)
admin_keys_app = typer.Typer(
    help="API keys and sidecar tokens, through the API.", no_args_is_help=True
)
admin_app.add_typer(lane_app, name="lane")
admin_app.add_typer(policy_app, name="policy")
admin_app.add_typer(audit_app, name="audit")
admin_app.add_typer(admin_keys_app, name="keys")

DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides BURSTGATE_DATABASE_URL.", show_default=False),
]

# ----------------------------------------------------------------- helpers


def _root_ctx(ctx: typer.Context) -> typer.Context:
    # Click hands ctx.obj down to sub-contexts; the options live there.
    return ctx


# ------------------------------------------------------------- connection


@admin_app.callback()
def _connect(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Option(envvar="BURSTGATE_ADMIN_TARGET", help="host:port of the server.")
    ] = DEFAULT_ADMIN_TARGET,
    api_key: ApiKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_server_name: TlsNameOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    ctx.obj = connection(target, api_key, tls_ca, tls_cert, tls_key, tls_server_name, timeout)


# ------------------------------------------------------------------ state


@admin_app.command("state")
def server_state(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Live server state: decisions by reason, pools' backpressure."""
    from controlplane._proto.burstgate.v1 import admission_pb2 as pb
    from controlplane.client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        s = c.call("GetServerState", apb.GetServerStateRequest())
    if as_json:
        echo_json(to_dict(s))
        return
    kv({"fastpath": s.fastpath, "tenants": s.tenants, "open_reservations": s.open_reservations,
         "config_reloads": s.config_reloads})  # fmt: skip
    typer.echo("")
    table(
        [{"decision": pb.Decision.Name(d.decision).removeprefix("DECISION_").lower(),
          "reason": pb.Reason.Name(d.reason).removeprefix("REASON_").lower()
                    if d.reason else "ok",
          "count": d.count} for d in s.decisions],
        ("decision", "reason", "count"),
    )  # fmt: skip
    if s.pools:
        typer.echo("")
        table(
            [{"pool": p.pool, "engines": p.engines_reporting,
              "backpressure": f"{p.backpressure_score:.3f}",
              "pricing_multiplier": p.pricing_multiplier} for p in s.pools],
            ("pool", "engines", "backpressure", "pricing_multiplier"),
        )  # fmt: skip


# ------------------------------------------------------------------ lanes


@lane_app.command("list")
def lane_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List lanes."""
    from controlplane.client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        lanes = c.call("ListLanes", apb.ListLanesRequest()).lanes
    rows = [to_dict(lane) for lane in lanes]
    if as_json:
        echo_json(rows)
    else:
        table(rows, ("name", "priority", "weight", "wait_target_ms", "fail_open", "degradable",
                      "max_queued", "pool"))  # fmt: skip


@lane_app.command("set")
def lane_set(
    ctx: typer.Context,
    name: str,
    weight: Annotated[str | None, typer.Option(help="Share in (0, 1].")] = None,
    wait_target_ms: Annotated[int | None, typer.Option(help="Queue-wait target (SLA), ms.")] = None,
    priority: Annotated[int | None, typer.Option(help="0 is served first.")] = None,
    fail_open: Annotated[bool | None, typer.Option("--fail-open/--no-fail-open")] = None,
    degradable: Annotated[bool | None, typer.Option("--degradable/--no-degradable")] = None,
    max_queued: Annotated[
        str | None, typer.Option(help="Queue bound, or 'none' (= policy).")
    ] = None,
    pool: Annotated[
        str | None,
        typer.Option(help="Engine pool when neither request nor tenant names one, or 'none'."),
    ] = None,
    create: Annotated[bool, typer.Option(help="Create the lane if it does not exist.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Change (or --create) a lane."""
    from google.protobuf.field_mask_pb2 import FieldMask

    from controlplane.client.admin import apb

    lane = apb.Lane(name=name)
    paths: list[str] = []
    for field, value in (("weight", weight), ("wait_target_ms", wait_target_ms),
                         ("priority", priority), ("fail_open", fail_open),
                         ("degradable", degradable)):  # fmt: skip
        if value is not None:
            setattr(lane, field, value)
            paths.append(field)
    given, mq = parse_limit(max_queued, "--max-queued")
    if given:
        paths.append("max_queued")
        if mq is not None:
            lane.max_queued = mq
    if pool is not None:
        paths.append("pool")
        if pool.lower() not in UNLIMITED:
            lane.pool = pool
    if not paths:
        fail("nothing to change: give at least one option (see --help)")
    with admin_client(_root_ctx(ctx)) as c:
        updated = c.call(
            "UpdateLane",
            apb.UpdateLaneRequest(
                lane=lane, update_mask=FieldMask(paths=paths), allow_missing=create
            ),
        )
    if as_json:
        echo_json(to_dict(updated))
    else:
        typer.echo(
            f"lane {name} updated: weight={updated.weight} "
            f"wait_target_ms={updated.wait_target_ms} priority={updated.priority}"
        )


# ----------------------------------------------------------------- policy


def _print_policy(p: Any, as_json: bool) -> None:
    rows = [{"key": s.key, "value": s.value_json, "default": s.default_json,
             "overridden": s.overridden} for s in p.settings]  # fmt: skip
    if as_json:
        echo_json({r["key"]: json.loads(r["value"]) for r in rows})
    else:
        table(rows, ("key", "value", "default", "overridden"))


@policy_app.command("show")
def policy_show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The effective policy, its defaults and which keys are overridden."""
    from controlplane.client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        _print_policy(c.call("GetPolicy", apb.GetPolicyRequest()), as_json)


@policy_app.command("set")
def policy_set(
    ctx: typer.Context,
    assignments: Annotated[list[str], typer.Argument(help="KEY=VALUE (JSON value) ...")],
    as_json: JsonOpt = False,
) -> None:
    """Override policy keys, e.g. `bp_hard_threshold=0.9 stale_policy=fail_closed`.
    Validated as a whole (the weights must still sum to 1)."""
    from controlplane.client.admin import apb

    values: dict[str, str] = {}
    for a in assignments:
        key, sep, value = a.partition("=")
        if not sep or not key:
            fail(f"expected KEY=VALUE, got {excerpt(a)}")
        values[key.strip()] = value.strip()
    with admin_client(_root_ctx(ctx)) as c:
        _print_policy(c.call("UpdatePolicy", apb.UpdatePolicyRequest(set=values)), as_json)


@policy_app.command("reset")
def policy_reset(
    ctx: typer.Context,
    keys: Annotated[list[str], typer.Argument(help="Keys back to their defaults.")],
    as_json: JsonOpt = False,
) -> None:
    """Remove overrides: the keys return to the server's defaults."""
    from controlplane.client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        _print_policy(c.call("UpdatePolicy", apb.UpdatePolicyRequest(reset=keys)), as_json)


# ------------------------------------------------------------------ audit


@audit_app.command("list")
def audit_list(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Option(help="e.g. tenant:acme, lane:batch, policy, key:<id>")
    ] = "",
    actor: Annotated[str, typer.Option(help="Substring of the actor (e.g. a key id).")] = "",
    action: Annotated[str, typer.Option(help="e.g. tenant.update")] = "",
    limit: Annotated[int, typer.Option(help="Most events to show (newest first).")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Changes made through the admin API and the key CLI, newest first."""
    from controlplane.client.admin import apb

    events: list[Any] = []
    token = ""
    with admin_client(_root_ctx(ctx)) as c:
        while len(events) < limit:
            resp = c.call("ListAuditEvents", apb.ListAuditEventsRequest(
                page_size=min(limit - len(events), 1000), page_token=token,
                target=target, actor=actor, action=action,
            ))  # fmt: skip
            events.extend(resp.events)
            token = resp.next_page_token
            if not token:
                break
    if as_json:
        echo_json([to_dict(e) for e in events])
        return
    rows = [{"id": e.id, "time": e.time.ToDatetime().strftime(TIME_FORMAT),
             "actor": e.actor, "action": e.action, "target": e.target,
             "change": _change(e.before_json, e.after_json)} for e in events]  # fmt: skip
    table(rows, ("id", "time", "actor", "action", "target", "change"))


def _change(before: str, after: str) -> str:
    b = json.loads(before) if before else {}
    a = json.loads(after) if after else {}
    if not b:
        return "created"
    if not a:
        return "deleted"

    def show(v: Any) -> str:
        return "unset" if v is None else cell(v)

    # Only what changed: an update records the whole object before and after.
    changed = [k for k in {**b, **a} if b.get(k) != a.get(k)]
    if not changed:
        return "no change"
    return ", ".join(f"{k}: {show(b.get(k))} -> {show(a.get(k))}" for k in changed)


# ------------------------------------------------------------------- keys


def _key_rows(keys: Sequence[Any], *, lists: bool = False) -> list[dict[str, Any]]:
    """Rows for the table (scopes comma-joined) or, ``lists``, for JSON."""

    def names(v: tuple[str, ...]) -> Any:
        return list(v) if lists else ",".join(v)

    return [{"key_id": k.key_id, "name": k.name, "role": k.role, "tenants": names(k.tenants),
             "pools": names(k.pools), "expires": k.expires, "last_used": k.last_used,
             "created_by": k.created_by, "created": k.created, "revoked": k.revoked}
            for k in keys]  # fmt: skip


class _KeyView:
    """A key as the tables show it (from the database or the API)."""

    def __init__(self, key_id: str, name: str, role: str, created_by: str, created: str,
                 revoked: str, tenants: Sequence[str] = (), pools: Sequence[str] = (),
                 expires: str = "", last_used: str = "") -> None:  # fmt: skip
        self.key_id, self.name, self.role = key_id, name, role
        self.created_by, self.created, self.revoked = created_by, created, revoked
        self.tenants, self.pools = tuple(tenants), tuple(pools)
        self.expires, self.last_used = expires, last_used


def _fmt_time(dt: Any) -> str:
    return dt.strftime(TIME_FORMAT) if dt is not None else ""


KEY_COLS = ("key_id", "name", "role", "tenants", "pools", "expires", "last_used",
            "created_by", "created", "revoked")  # fmt: skip

# The options that give a key its scope and expiry (both `keys create` commands).
TenantScopeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tenant",
        help="Sidecar keys: a tenant id or glob pattern (team-*) the key serves; repeat for "
        "more; '*' = every tenant. Required for --role sidecar.",
    ),
]
PoolScopeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--pool",
        help="Sidecar keys: an engine pool (or pattern) the key serves; repeat for more; "
        "'*' = every pool. Required for --role sidecar.",
    ),
]
ExpiresInOpt = Annotated[
    str | None,
    typer.Option(
        "--expires-in",
        help="Refuse the key after this long: 90s, 15m, 12h, 30d, 2w (any role; max 3650d).",
    ),
]


def expiry_option(expires_in: str | None) -> Any:
    """``--expires-in`` as an aware datetime (None = never); exits 2 on a bad value."""
    from controlplane.domain.errors import InvalidArgument
    from controlplane.domain.keys import expiry_after

    if expires_in is None:
        return None
    try:
        return expiry_after("--expires-in", expires_in)
    except InvalidArgument as exc:
        fail(str(exc))


def _print_new_key(secret: str, key_id: str, role: str, as_json: bool) -> None:
    if as_json:
        echo_json({"key_id": key_id, "role": role, "key": secret})
        return
    typer.echo(secret)
    typer.echo(
        f"created {role} key {key_id}; the key above is shown only now. "
        "Use it as BURSTGATE_API_KEY (or a sidecar's bearer token).",
        err=True,
    )


@admin_keys_app.command("list")
def admin_keys_list(
    ctx: typer.Context,
    include_revoked: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List keys (never the secrets)."""
    from controlplane.client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        keys = c.call("ListApiKeys", apb.ListApiKeysRequest(include_revoked=include_revoked)).keys
    if as_json:
        echo_json([to_dict(k) for k in keys])
        return

    def when(k: Any, name: str) -> str:
        return _fmt_time(getattr(k, name).ToDatetime()) if k.HasField(name) else ""

    views = [_KeyView(k.key_id, k.name, k.role, k.created_by, when(k, "create_time"),
                      when(k, "revoke_time"), k.tenants, k.pools, when(k, "expire_time"),
                      when(k, "last_used_time"))
             for k in keys]  # fmt: skip
    table(_key_rows(views), KEY_COLS)


@admin_keys_app.command("create")
def admin_keys_create(
    ctx: typer.Context,
    role: Annotated[Role, typer.Option(case_sensitive=False, help="What the key may do.")],
    name: Annotated[str, typer.Option(help="Who or what uses the key.")],
    tenant: TenantScopeOpt = None,
    pool: PoolScopeOpt = None,
    expires_in: ExpiresInOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a key; prints it once. A sidecar key names the tenants and
    pools it serves (--tenant, --pool; '*' = all)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from controlplane.client.admin import apb

    expires_at = expiry_option(expires_in)
    request = apb.CreateApiKeyRequest(
        name=name, role=role.value, tenants=tenant or [], pools=pool or []
    )
    if expires_at is not None:
        request.expire_time.CopyFrom(Timestamp(seconds=int(expires_at.timestamp())))
    with admin_client(_root_ctx(ctx)) as c:
        r = c.call("CreateApiKey", request)
    _print_new_key(r.secret, r.key.key_id, r.key.role, as_json)


@admin_keys_app.command("revoke")
def admin_keys_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke a key; refused from the next call on."""
    from controlplane.client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        c.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=key_id))
    typer.echo(f"key {key_id} revoked")
