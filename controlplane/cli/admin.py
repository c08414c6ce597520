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
from typing import Annotated, Any

import typer

from controlplane.cli.common import (
    UNLIMITED,
    JsonOpt,
    admin_client,
    connect_options,
    echo_json,
    fail,
    parse_limit,
    to_dict,
)
from controlplane.cli.keyviews import (
    KEY_COLS,
    ExpiresInOpt,
    KeyView,
    PoolScopeOpt,
    TenantScopeOpt,
    expiry_option,
    fmt_time,
    key_rows,
    print_new_key,
)
from controlplane.cli.render import TIME_FORMAT, cell, kv, table
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


admin_app.callback()(connect_options)


# ------------------------------------------------------------------ state


@admin_app.command("state")
def server_state(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh every --interval until Ctrl-C.")
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.2, help="Seconds between refreshes with --watch.")
    ] = 2.0,
    count: Annotated[
        int | None, typer.Option(min=1, help="With --watch: stop after this many refreshes.")
    ] = None,
) -> None:
    """Live server state: decisions by reason, pools' backpressure.

    With --watch the screen is redrawn every --interval seconds (on a
    terminal; into a pipe each refresh is appended after a time line, and
    --json prints one JSON object per line)."""
    import time

    from burstgate_client.admin import apb

    if not watch:
        count = 1
    shown = 0
    with admin_client(_root_ctx(ctx)) as c:
        try:
            while True:
                s = c.call("GetServerState", apb.GetServerStateRequest())
                _print_state(s, as_json, watch, first=shown == 0)
                shown += 1
                if count is not None and shown >= count:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass


def _print_state(s: Any, as_json: bool, watch: bool, *, first: bool) -> None:
    import sys
    from datetime import UTC, datetime

    from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
    from rich.console import Console

    if as_json:
        if watch:  # one object per line: a stream `jq` can read
            typer.echo(json.dumps(to_dict(s), separators=(",", ":")))
        else:
            echo_json(to_dict(s))
        return
    if watch:
        if sys.stdout.isatty():
            Console().clear()
        elif not first:
            typer.echo("")
        typer.echo(f"as of {datetime.now(UTC).strftime(TIME_FORMAT)} UTC")
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
    from burstgate_client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        lanes = c.call("ListLanes", apb.ListLanesRequest()).lanes
    rows = [to_dict(lane) for lane in lanes]
    if as_json:
        echo_json(rows)
    else:
        for row in rows:  # unset: the policy's lane_queue_limit applies
            row.setdefault("max_queued", "policy")
            for flag in ("fail_open", "degradable"):
                row.setdefault(flag, False)  # proto3 drops false from the JSON form
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
    from burstgate_client.admin import apb
    from google.protobuf.field_mask_pb2 import FieldMask

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
    from burstgate_client.admin import apb

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
    from burstgate_client.admin import apb

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
    from burstgate_client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        _print_policy(c.call("UpdatePolicy", apb.UpdatePolicyRequest(reset=keys)), as_json)


# ------------------------------------------------------------------ audit


def _object_not_target(ctx: typer.Context) -> None:
    """`audit list --target tenant:acme` was the filter before --target
    could follow the command: say so rather than dial host "tenant"."""
    target = str((ctx.obj or {}).get("target", ""))
    kind = target.partition(":")[0]
    if kind in ("tenant", "lane", "policy", "key", "price", "pool") and not target.rpartition(
        ":"
    )[2].isdigit():
        fail(f"--target: {target!r} is not HOST:PORT; to filter the audit log by what "
             f"changed, use --object {target}")  # fmt: skip


@audit_app.command("list")
def audit_list(
    ctx: typer.Context,
    about: Annotated[
        str,
        typer.Option(
            "--object",
            help="What was changed: e.g. tenant:acme, lane:batch, policy, key:<id>.",
            show_default=False,
        ),
    ] = "",
    actor: Annotated[str, typer.Option(help="Substring of the actor (e.g. a key id).")] = "",
    action: Annotated[str, typer.Option(help="e.g. tenant.update")] = "",
    limit: Annotated[int, typer.Option(help="Most events to show (newest first).")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Changes made through the admin API and the key CLI, newest first.

    --object filters by what was changed (the `target` column); --target is
    the server, as for every admin command."""
    from burstgate_client.admin import apb

    _object_not_target(ctx)

    events: list[Any] = []
    token = ""
    with admin_client(_root_ctx(ctx)) as c:
        while len(events) < limit:
            resp = c.call("ListAuditEvents", apb.ListAuditEventsRequest(
                page_size=min(limit - len(events), 1000), page_token=token,
                target=about, actor=actor, action=action,
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


@admin_keys_app.command("list")
def admin_keys_list(
    ctx: typer.Context,
    include_revoked: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List keys (never the secrets)."""
    from burstgate_client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        keys = c.call("ListApiKeys", apb.ListApiKeysRequest(include_revoked=include_revoked)).keys
    if as_json:
        echo_json([to_dict(k) for k in keys])
        return

    def when(k: Any, name: str) -> str:
        return fmt_time(getattr(k, name).ToDatetime()) if k.HasField(name) else ""

    views = [KeyView(k.key_id, k.name, k.role, k.created_by, when(k, "create_time"),
                      when(k, "revoke_time"), k.tenants, k.pools, when(k, "expire_time"),
                      when(k, "last_used_time"))
             for k in keys]  # fmt: skip
    table(key_rows(views), KEY_COLS)


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
    from burstgate_client.admin import apb
    from google.protobuf.timestamp_pb2 import Timestamp

    expires_at = expiry_option(expires_in)
    request = apb.CreateApiKeyRequest(
        name=name, role=role.value, tenants=tenant or [], pools=pool or []
    )
    if expires_at is not None:
        request.expire_time.CopyFrom(Timestamp(seconds=int(expires_at.timestamp())))
    with admin_client(_root_ctx(ctx)) as c:
        r = c.call("CreateApiKey", request)
    print_new_key(r.secret, r.key.key_id, r.key.role, as_json)


@admin_keys_app.command("revoke")
def admin_keys_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke a key; refused from the next call on."""
    from burstgate_client.admin import apb

    with admin_client(_root_ctx(ctx)) as c:
        c.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=key_id))
    typer.echo(f"key {key_id} revoked")
