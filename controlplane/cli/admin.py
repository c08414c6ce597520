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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

ADMIN_HELP = """Operate a running server through the admin API (gRPC, needs an API key).

Connection: --target / BURSTGATE_ADMIN_TARGET, --api-key / BURSTGATE_API_KEY
(create one with `burstgate keys create --role admin`). Changes are
validated, audited and live before the command returns."""

admin_app = typer.Typer(help=ADMIN_HELP, no_args_is_help=True)
tenant_app = typer.Typer(
    help="Tenants: add, list, show, update, disable, delete.", no_args_is_help=True
)
limits_app = typer.Typer(help="A tenant's limits (rate, burst, quotas, ...).", no_args_is_help=True)
lane_app = typer.Typer(help="Priority lanes: weights and wait targets.", no_args_is_help=True)
policy_app = typer.Typer(
    help="Burst-shaping policy (backpressure, degradation, queues).", no_args_is_help=True
)
audit_app = typer.Typer(help="The audit log of changes.", no_args_is_help=True)
admin_keys_app = typer.Typer(
    help="API keys and sidecar tokens, through the API.", no_args_is_help=True
)
admin_app.add_typer(tenant_app, name="tenant")
admin_app.add_typer(limits_app, name="limits")
admin_app.add_typer(lane_app, name="lane")
admin_app.add_typer(policy_app, name="policy")
admin_app.add_typer(audit_app, name="audit")
admin_app.add_typer(admin_keys_app, name="keys")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides BURSTGATE_DATABASE_URL.", show_default=False),
]
UNLIMITED = ("unlimited", "none", "-")

# ----------------------------------------------------------------- helpers


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _to_dict(msg: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    d: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True)
    return d


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=False))


def _table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> None:
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    for r in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _kv(d: dict[str, Any]) -> None:
    width = max((len(k) for k in d), default=0)
    for k, v in d.items():
        typer.echo(f"{k.ljust(width)}  {_cell(v)}")


@contextmanager
def _client(ctx: typer.Context) -> Iterator[Any]:
    """The AdminClient for the connection options; RPC errors -> exit 2."""
    import grpc

    from controlplane.client.admin import AdminClient

    opts: dict[str, Any] = ctx.obj or {}
    key = opts.get("api_key")
    if not key:
        _fail("no API key: pass --api-key or set BURSTGATE_API_KEY "
              "(create one with `burstgate keys create --role admin`)")  # fmt: skip
    client = AdminClient(opts["target"], key, tls=opts.get("tls"), timeout=opts["timeout"])
    try:
        yield client
    except grpc.RpcError as exc:
        code = exc.code()
        name = code.name if code is not None else "UNKNOWN"
        _fail(f"{name}: {exc.details()}")
    finally:
        client.close()


def _limit(value: str | None, name: str) -> tuple[bool, int | None]:
    """(given, value) for a limit option; 'unlimited' clears it."""
    if value is None:
        return False, None
    if value.strip().lower() in UNLIMITED:
        return True, None
    try:
        return True, int(value.replace("_", ""))
    except ValueError:
        _fail(f"{name}: not an integer or 'unlimited': {value!r}")


def _root_ctx(ctx: typer.Context) -> typer.Context:
    # Click hands ctx.obj down to sub-contexts; the options live there.
    return ctx


# ------------------------------------------------------------- connection


@admin_app.callback()
def _connect(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Option(envvar="BURSTGATE_ADMIN_TARGET", help="host:port of the server.")
    ] = "127.0.0.1:50051",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="BURSTGATE_API_KEY", help="An admin or viewer key.", show_default=False
        ),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option(envvar="BURSTGATE_ADMIN_TLS_CA", help="CA of the server cert (PEM)."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(envvar="BURSTGATE_ADMIN_TLS_CERT", help="Client cert (mTLS).")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(envvar="BURSTGATE_ADMIN_TLS_KEY", help="Client key (mTLS).")
    ] = None,
    tls_server_name: Annotated[
        str | None, typer.Option(help="Name to check the server certificate against.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per call.")] = 10.0,
) -> None:
    from controlplane.client.admin import TlsFiles

    tls = TlsFiles(tls_ca, tls_cert, tls_key, tls_server_name) if (tls_ca or tls_cert) else None
    ctx.obj = {"target": target, "api_key": api_key, "tls": tls, "timeout": timeout}


# ---------------------------------------------------------------- tenants

TENANT_COLS = (
    "tenant_id", "enabled", "token_rate", "burst_tokens", "hourly_quota", "daily_quota",
    "max_concurrency", "default_lane", "shadow_mode",
)  # fmt: skip


LIMIT_FIELDS = ("hourly_quota", "daily_quota", "max_concurrency", "max_queued",
                "max_tokens_per_request", "dedicated_quota")  # fmt: skip


def _tenant_row(t: Any) -> dict[str, Any]:
    """The tenant's fields in proto order; unset limits read "unlimited"."""
    d = _to_dict(t)
    row: dict[str, Any] = {}
    for field in t.DESCRIPTOR.fields:
        name = field.name
        if name in d:
            row[name] = d[name]
        elif name in LIMIT_FIELDS:
            row[name] = "unlimited"
        elif field.type == field.TYPE_BOOL:
            row[name] = False
        elif name in ("fallback_model", "max_wait_ms", "long_request_tokens"):
            row[name] = "-"
    return row


@tenant_app.command("list")
def tenant_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List tenants (all pages)."""
    with _client(_root_ctx(ctx)) as c:
        tenants = c.list_tenants()
    if as_json:
        _echo_json([_to_dict(t) for t in tenants])
    else:
        _table([_tenant_row(t) for t in tenants], TENANT_COLS)


@tenant_app.command("show")
def tenant_show(ctx: typer.Context, tenant_id: str, as_json: JsonOpt = False) -> None:
    """A tenant's limits and its live state (bucket, quota used, in flight)."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        tenant = c.call("GetTenant", apb.GetTenantRequest(tenant_id=tenant_id))
        state = c.call("GetTenantState", apb.GetTenantStateRequest(tenant_id=tenant_id))
    if as_json:
        _echo_json({"tenant": _to_dict(tenant), "state": _to_dict(state)})
        return
    _kv(_tenant_row(tenant))
    typer.echo("")
    live = _to_dict(state)
    live.pop("tenant_id", None)
    shown = {k: live.get(k, 0) for k in (
        "bucket_tokens", "burst_tokens", "hourly_used_tokens", "hourly_quota",
        "daily_used_tokens", "daily_quota", "in_flight_requests", "in_flight_tokens",
        "queued_requests", "as_of",
    )}  # fmt: skip
    for k in ("hourly_quota", "daily_quota"):
        if str(shown[k]) == "-1":
            shown[k] = "unlimited"
    _kv(shown)


def _print_tenant(t: Any, as_json: bool, verb: str) -> None:
    if as_json:
        _echo_json(_to_dict(t))
    else:
        typer.echo(f"tenant {t.tenant_id} {verb}")


RateOpt = Annotated[str | None, typer.Option("--rate", help="Token refill, tokens/s.")]
BurstOpt = Annotated[int | None, typer.Option("--burst", help="Bucket capacity, tokens.")]
HourlyOpt = Annotated[str | None, typer.Option(help="Tokens per UTC hour, or 'unlimited'.")]
DailyOpt = Annotated[str | None, typer.Option(help="Tokens per UTC day, or 'unlimited'.")]
ConcOpt = Annotated[str | None, typer.Option(help="Requests in flight, or 'unlimited'.")]
QueuedOpt = Annotated[str | None, typer.Option(help="Requests queued, or 'unlimited'.")]
MaxTokOpt = Annotated[str | None, typer.Option(help="Cap on prompt + max_tokens per request.")]
DedicatedOpt = Annotated[str | None, typer.Option(help="Hard token cap, or 'unlimited'.")]
ShadowOpt = Annotated[
    bool | None, typer.Option("--shadow-mode/--no-shadow-mode", help="Decide and count, but admit.")
]


def _limit_fields(
    rate: str | None, burst: int | None, hourly: str | None, daily: str | None,
    conc: str | None, queued: str | None, maxtok: str | None, dedicated: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Tenant field -> value (None = clear) for the options given."""
    fields: dict[str, Any] = {}
    if rate is not None:
        fields["token_rate"] = rate
    if burst is not None:
        fields["burst_tokens"] = burst
    for name, value in (
        ("hourly_quota", hourly), ("daily_quota", daily), ("max_concurrency", conc),
        ("max_queued", queued), ("max_tokens_per_request", maxtok),
        ("dedicated_quota", dedicated),
    ):  # fmt: skip
        given, v = _limit(value, "--" + name.replace("_", "-"))
        if given:
            fields[name] = v
    return fields


def _update(ctx: typer.Context, tenant_id: str, fields: dict[str, Any], as_json: bool) -> None:
    from google.protobuf.field_mask_pb2 import FieldMask

    from controlplane.client.admin import apb

    if not fields:
        _fail("nothing to change: give at least one option (see --help)")
    t = apb.Tenant(tenant_id=tenant_id)
    for name, value in fields.items():
        if value is not None:
            setattr(t, name, value)
    with _client(_root_ctx(ctx)) as c:
        updated = c.call(
            "UpdateTenant",
            apb.UpdateTenantRequest(tenant=t, update_mask=FieldMask(paths=list(fields))),
        )
    if as_json:
        _echo_json(_to_dict(updated))
    else:
        shown = [
            f"{k}={_cell(getattr(updated, k))}"
            if k in _PLAIN or updated.HasField(k)
            else f"{k}=unlimited"
            for k in fields
        ]
        typer.echo(f"tenant {tenant_id} updated: " + ", ".join(shown))


# Tenant fields without presence (always printed as is).
_PLAIN = frozenset({"token_rate", "burst_tokens", "default_lane", "display_name", "shadow_mode"})


@tenant_app.command("add")
def tenant_add(
    ctx: typer.Context,
    tenant_id: Annotated[str, typer.Argument(help="Tenant id as sidecars send it.")],
    rate: Annotated[str, typer.Option("--rate", help="Token refill, tokens/s (3 decimals).")],
    burst: Annotated[int, typer.Option("--burst", help="Bucket capacity, tokens.")],
    hourly_quota: HourlyOpt = None,
    daily_quota: DailyOpt = None,
    max_concurrency: ConcOpt = None,
    max_queued: QueuedOpt = None,
    max_tokens_per_request: MaxTokOpt = None,
    dedicated_quota: DedicatedOpt = None,
    default_lane: Annotated[str, typer.Option(help="Lane when a request names none.")] = "standard",
    display_name: Annotated[str, typer.Option(help="Human-readable name.")] = "",
    fallback_model: Annotated[str | None, typer.Option(help="Model to degrade to.")] = None,
    shadow_mode: Annotated[bool, typer.Option("--shadow-mode/--no-shadow-mode")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create a tenant."""
    from controlplane.client.admin import apb

    fields = _limit_fields(rate, burst, hourly_quota, daily_quota, max_concurrency, max_queued,
                           max_tokens_per_request, dedicated_quota)  # fmt: skip
    t = apb.Tenant(tenant_id=tenant_id, default_lane=default_lane, display_name=display_name,
                   shadow_mode=shadow_mode)  # fmt: skip
    if fallback_model is not None:
        t.fallback_model = fallback_model
    for name, value in fields.items():
        if value is not None:
            setattr(t, name, value)
    with _client(_root_ctx(ctx)) as c:
        created = c.call("CreateTenant", apb.CreateTenantRequest(tenant=t))
    _print_tenant(created, as_json, "added")


@tenant_app.command("update")
def tenant_update(
    ctx: typer.Context,
    tenant_id: str,
    display_name: Annotated[str | None, typer.Option(help="Human-readable name.")] = None,
    default_lane: Annotated[
        str | None, typer.Option(help="Lane when a request names none.")
    ] = None,
    fallback_model: Annotated[
        str | None, typer.Option(help="Model to degrade to, or 'none'.")
    ] = None,
    max_wait_ms: Annotated[
        str | None, typer.Option(help="Longest queue wait, or 'none' (= the lane's target).")
    ] = None,
    long_request_tokens: Annotated[
        str | None, typer.Option(help="Length-aware placement threshold, or 'none' (= policy).")
    ] = None,
    demote_long_requests: Annotated[
        bool | None, typer.Option("--demote-long-requests/--no-demote-long-requests")
    ] = None,
    shadow_mode: ShadowOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a tenant's settings other than limits (see `admin limits set`)."""
    fields: dict[str, Any] = {}
    if display_name is not None:
        fields["display_name"] = display_name
    if default_lane is not None:
        fields["default_lane"] = default_lane
    if fallback_model is not None:
        fields["fallback_model"] = None if fallback_model.lower() in UNLIMITED else fallback_model
    for name, value in (("max_wait_ms", max_wait_ms), ("long_request_tokens", long_request_tokens)):
        given, v = _limit(value, "--" + name.replace("_", "-"))
        if given:
            fields[name] = v
    if demote_long_requests is not None:
        fields["demote_long_requests"] = demote_long_requests
    if shadow_mode is not None:
        fields["shadow_mode"] = shadow_mode
    _update(ctx, tenant_id, fields, as_json)


@limits_app.command("set")
def limits_set(
    ctx: typer.Context,
    tenant_id: str,
    rate: RateOpt = None,
    burst: BurstOpt = None,
    hourly_quota: HourlyOpt = None,
    daily_quota: DailyOpt = None,
    max_concurrency: ConcOpt = None,
    max_queued: QueuedOpt = None,
    max_tokens_per_request: MaxTokOpt = None,
    dedicated_quota: DedicatedOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a tenant's limits; live on the fast path when this returns.
    Bucket levels and in-flight requests are kept."""
    fields = _limit_fields(rate, burst, hourly_quota, daily_quota, max_concurrency, max_queued,
                           max_tokens_per_request, dedicated_quota)  # fmt: skip
    _update(ctx, tenant_id, fields, as_json)


@tenant_app.command("disable")
def tenant_disable(ctx: typer.Context, tenant_id: str, as_json: JsonOpt = False) -> None:
    """Refuse the tenant's requests (TENANT_DISABLED)."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        t = c.call("DisableTenant", apb.DisableTenantRequest(tenant_id=tenant_id))
    _print_tenant(t, as_json, "disabled")


@tenant_app.command("enable")
def tenant_enable(ctx: typer.Context, tenant_id: str, as_json: JsonOpt = False) -> None:
    """Admit the tenant's requests again."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        t = c.call("EnableTenant", apb.EnableTenantRequest(tenant_id=tenant_id))
    _print_tenant(t, as_json, "enabled")


@tenant_app.command("delete")
def tenant_delete(
    ctx: typer.Context,
    tenant_id: str,
    force: Annotated[bool, typer.Option(help="Delete even with unsettled reservations.")] = False,
) -> None:
    """Delete a tenant (refused while it has unsettled reservations, unless --force)."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        r = c.call("DeleteTenant", apb.DeleteTenantRequest(tenant_id=tenant_id, force=force))
    typer.echo(f"tenant {tenant_id} deleted ({r.open_reservations} unsettled reservations)")


# ------------------------------------------------------------------ state


@admin_app.command("state")
def server_state(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Live server state: decisions by reason, pools' backpressure."""
    from controlplane._proto.burstgate.v1 import admission_pb2 as pb
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        s = c.call("GetServerState", apb.GetServerStateRequest())
    if as_json:
        _echo_json(_to_dict(s))
        return
    _kv({"fastpath": s.fastpath, "tenants": s.tenants, "open_reservations": s.open_reservations,
         "config_reloads": s.config_reloads})  # fmt: skip
    typer.echo("")
    _table(
        [{"decision": pb.Decision.Name(d.decision).removeprefix("DECISION_").lower(),
          "reason": pb.Reason.Name(d.reason).removeprefix("REASON_").lower()
                    if d.reason else "ok",
          "count": d.count} for d in s.decisions],
        ("decision", "reason", "count"),
    )  # fmt: skip
    if s.pools:
        typer.echo("")
        _table(
            [{"pool": p.pool, "engines": p.engines_reporting,
              "backpressure": f"{p.backpressure_score:.3f}",
              "pricing_multiplier": f"{p.pricing_multiplier:g}"} for p in s.pools],
            ("pool", "engines", "backpressure", "pricing_multiplier"),
        )  # fmt: skip


# ------------------------------------------------------------------ lanes


@lane_app.command("list")
def lane_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List lanes."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        lanes = c.call("ListLanes", apb.ListLanesRequest()).lanes
    rows = [_to_dict(lane) for lane in lanes]
    if as_json:
        _echo_json(rows)
    else:
        _table(rows, ("name", "priority", "weight", "wait_target_ms", "fail_open", "degradable",
                      "max_queued"))  # fmt: skip


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
    given, mq = _limit(max_queued, "--max-queued")
    if given:
        paths.append("max_queued")
        if mq is not None:
            lane.max_queued = mq
    if not paths:
        _fail("nothing to change: give at least one option (see --help)")
    with _client(_root_ctx(ctx)) as c:
        updated = c.call(
            "UpdateLane",
            apb.UpdateLaneRequest(
                lane=lane, update_mask=FieldMask(paths=paths), allow_missing=create
            ),
        )
    if as_json:
        _echo_json(_to_dict(updated))
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
        _echo_json({r["key"]: json.loads(r["value"]) for r in rows})
    else:
        _table(rows, ("key", "value", "default", "overridden"))


@policy_app.command("show")
def policy_show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The effective policy, its defaults and which keys are overridden."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
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
            _fail(f"expected KEY=VALUE, got {a!r}")
        values[key.strip()] = value.strip()
    with _client(_root_ctx(ctx)) as c:
        _print_policy(c.call("UpdatePolicy", apb.UpdatePolicyRequest(set=values)), as_json)


@policy_app.command("reset")
def policy_reset(
    ctx: typer.Context,
    keys: Annotated[list[str], typer.Argument(help="Keys back to their defaults.")],
    as_json: JsonOpt = False,
) -> None:
    """Remove overrides: the keys return to the server's defaults."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
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
    with _client(_root_ctx(ctx)) as c:
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
        _echo_json([_to_dict(e) for e in events])
        return
    rows = [{"id": e.id, "time": e.time.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
             "actor": e.actor, "action": e.action, "target": e.target,
             "change": _change(e.before_json, e.after_json)} for e in events]  # fmt: skip
    _table(rows, ("id", "time", "actor", "action", "target", "change"))


def _change(before: str, after: str) -> str:
    b = json.loads(before) if before else {}
    a = json.loads(after) if after else {}
    if not b:
        return "created"
    if not a:
        return "deleted"

    def show(v: Any) -> str:
        return "unset" if v is None else _cell(v)

    return ", ".join(f"{k}: {show(b.get(k))} -> {show(a.get(k))}" for k in a)


# ------------------------------------------------------------------- keys


def _key_rows(keys: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"key_id": k.key_id, "name": k.name, "role": k.role, "created_by": k.created_by,
             "created": k.created, "revoked": k.revoked} for k in keys]  # fmt: skip


class _KeyView:
    def __init__(self, key_id: str, name: str, role: str, created_by: str, created: str,
                 revoked: str) -> None:  # fmt: skip
        self.key_id, self.name, self.role = key_id, name, role
        self.created_by, self.created, self.revoked = created_by, created, revoked


def _fmt_time(dt: Any) -> str:
    return dt.strftime("%Y-%m-%d %H:%M:%S") if dt is not None else ""


KEY_COLS = ("key_id", "name", "role", "created_by", "created", "revoked")


def _print_new_key(secret: str, key_id: str, role: str, as_json: bool) -> None:
    if as_json:
        _echo_json({"key_id": key_id, "role": role, "key": secret})
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

    with _client(_root_ctx(ctx)) as c:
        keys = c.call("ListApiKeys", apb.ListApiKeysRequest(include_revoked=include_revoked)).keys
    if as_json:
        _echo_json([_to_dict(k) for k in keys])
        return
    views = [_KeyView(k.key_id, k.name, k.role, k.created_by,
                      _fmt_time(k.create_time.ToDatetime()),
                      _fmt_time(k.revoke_time.ToDatetime()) if k.HasField("revoke_time") else "")
             for k in keys]  # fmt: skip
    _table(_key_rows(views), KEY_COLS)


@admin_keys_app.command("create")
def admin_keys_create(
    ctx: typer.Context,
    role: Annotated[str, typer.Option(help="admin | viewer | sidecar")],
    name: Annotated[str, typer.Option(help="Who or what uses the key.")],
    as_json: JsonOpt = False,
) -> None:
    """Create a key; prints it once."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        r = c.call("CreateApiKey", apb.CreateApiKeyRequest(name=name, role=role))
    _print_new_key(r.secret, r.key.key_id, r.key.role, as_json)


@admin_keys_app.command("revoke")
def admin_keys_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke a key; refused from the next call on."""
    from controlplane.client.admin import apb

    with _client(_root_ctx(ctx)) as c:
        c.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=key_id))
    typer.echo(f"key {key_id} revoked")
