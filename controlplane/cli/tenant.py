"""``burstgate tenant ...``: the one tenant CLI.

Every change goes through the config repository (``controlplane.store.config``),
validated by ``controlplane.domain.validate`` and audited in the same
transaction, by one of two routes chosen per invocation:

- **through the admin API** when a server is named (``--target`` or
  ``BURSTGATE_ADMIN_TARGET``; needs ``--api-key``/``BURSTGATE_API_KEY``): the
  server writes the change, audits it as the calling key and makes it live
  before the command returns; ``show`` adds the tenant's live state;
- **directly on the database** otherwise (``--database-url`` or
  ``BURSTGATE_DATABASE_URL``): the bootstrap path, no server needed. The same
  conversions and repository calls as the admin API's, audited as
  ``local:<os user>``; a running server picks the change up within
  ``BURSTGATE_CONFIG_POLL_S``.

Both routes print the same output (the admin API's Tenant message, as a
table or ``--json``) and report errors as ``error: CODE: field: message``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from controlplane.cli.common import (
    UNLIMITED,
    ApiKeyOpt,
    DbOpt,
    JsonOpt,
    TimeoutOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TlsNameOpt,
    admin_client,
    connection,
    echo_json,
    fail,
    parse_limit,
    settings,
    to_dict,
)
from controlplane.cli.render import cell, kv, table

TENANT_HELP = """Tenants: add, list, show, update, limits, enable, disable, delete.

Through a running server's admin API when --target / BURSTGATE_ADMIN_TARGET
is given (with --api-key / BURSTGATE_API_KEY); otherwise directly on the
database (--database-url / BURSTGATE_DATABASE_URL), audited as local:<os user>.
Options go before the command: `burstgate tenant --target HOST:PORT list`."""

tenant_app = typer.Typer(help=TENANT_HELP, no_args_is_help=True)


@tenant_app.callback()
def _connect(
    ctx: typer.Context,
    target: Annotated[
        str | None,
        typer.Option(
            envvar="BURSTGATE_ADMIN_TARGET",
            help="host:port of a running server: go through its admin API.",
            show_default=False,
        ),
    ] = None,
    api_key: ApiKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_server_name: TlsNameOpt = None,
    timeout: TimeoutOpt = 10.0,
    database_url: DbOpt = None,
) -> None:
    if target and database_url:
        fail("give --target (through a server) or --database-url (direct), not both")
    ctx.obj = connection(target or "", api_key, tls_ca, tls_cert, tls_key, tls_server_name, timeout)
    ctx.obj["database_url"] = database_url


class LocalTenants:
    """The admin API's tenant calls served in-process on the database (the
    route without a server): the servicer's conversions and the same
    repository methods, with ``actor`` in the audit log."""

    def __init__(self, repo: Any, actor: Any) -> None:
        self.repo = repo
        self.actor = actor

    def call(self, method: str, request: Any) -> Any:
        return getattr(self, method)(request)

    def list_tenants(self) -> list[Any]:
        from controlplane.rpc.admin_pb import tenant_to_pb

        out: list[Any] = []
        after = ""
        while True:
            page, after = self.repo.list_tenants(1000, after)
            out.extend(tenant_to_pb(r) for r in page)
            if not after:
                return out

    def CreateTenant(self, request: Any) -> Any:
        from controlplane.rpc.admin_pb import tenant_from_pb, tenant_to_pb

        return tenant_to_pb(self.repo.add_tenant(tenant_from_pb(request.tenant), self.actor))

    def GetTenant(self, request: Any) -> Any:
        from controlplane.rpc.admin_pb import tenant_to_pb

        return tenant_to_pb(self.repo.get_tenant(request.tenant_id))

    def GetTenantState(self, request: Any) -> None:
        return None  # live state is the server's; there is none without one

    def UpdateTenant(self, request: Any) -> Any:
        from controlplane.rpc.admin_pb import tenant_changes, tenant_to_pb

        changes = tenant_changes(request.tenant, list(request.update_mask.paths))
        return tenant_to_pb(self.repo.update_tenant(request.tenant.tenant_id, changes, self.actor))

    def EnableTenant(self, request: Any) -> Any:
        from controlplane.rpc.admin_pb import tenant_to_pb

        return tenant_to_pb(self.repo.set_enabled(request.tenant_id, True, self.actor))

    def DisableTenant(self, request: Any) -> Any:
        from controlplane.rpc.admin_pb import tenant_to_pb

        return tenant_to_pb(self.repo.set_enabled(request.tenant_id, False, self.actor))

    def DeleteTenant(self, request: Any) -> Any:
        from burstgate_client.admin import apb

        from controlplane.domain.errors import FailedPrecondition
        from controlplane.rpc.admin_pb import tenant_to_pb

        if not request.force:
            # Unsettled reservations live in a server's memory: only the
            # admin API can check them.
            raise FailedPrecondition(
                "tenant_id: without a server the CLI cannot check for unsettled "
                "reservations; delete through the admin API (--target) or with --force"
            )
        rec = self.repo.delete_tenant(request.tenant_id, self.actor)
        return apb.DeleteTenantResponse(tenant=tenant_to_pb(rec), open_reservations=0)


@contextmanager
def _tenants(ctx: typer.Context) -> Iterator[Any]:
    """The admin client (a server was named) or LocalTenants on the database."""
    opts: dict[str, Any] = ctx.obj or {}
    if opts.get("target"):
        with admin_client(ctx) as client:
            yield client
        return
    from controlplane.domain.errors import DomainError
    from controlplane.rpc.errors import status_for
    from controlplane.store.audit import local_actor
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine

    engine = make_engine(settings(database_url=opts.get("database_url")).database_url)
    try:
        yield LocalTenants(ConfigRepository(engine), local_actor())
    except DomainError as exc:
        fail(f"{status_for(exc).name}: {exc}")
    finally:
        engine.dispose()


TENANT_COLS = (
    "tenant_id", "enabled", "token_rate", "burst_tokens", "hourly_quota", "daily_quota",
    "max_concurrency", "default_lane", "shadow_mode",
)  # fmt: skip


LIMIT_FIELDS = ("hourly_quota", "daily_quota", "max_concurrency", "max_queued",
                "max_tokens_per_request", "dedicated_quota")  # fmt: skip


def _tenant_row(t: Any) -> dict[str, Any]:
    """The tenant's fields in proto order; unset limits read "unlimited"."""
    d = to_dict(t)
    row: dict[str, Any] = {}
    for field in t.DESCRIPTOR.fields:
        name = field.name
        if field.message_type is not None and field.message_type.name == "Timestamp":
            row[name] = getattr(t, name).ToDatetime() if t.HasField(name) else None
        elif name in d:
            row[name] = d[name]
        elif name in LIMIT_FIELDS:
            row[name] = "unlimited"
        elif field.type == field.TYPE_BOOL:
            row[name] = False
        elif name in ("fallback_model", "max_wait_ms", "long_request_tokens", "pool"):
            row[name] = "-"
    return row


@tenant_app.command("list")
def tenant_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List tenants (all pages)."""
    with _tenants(ctx) as c:
        tenants = c.list_tenants()
    if as_json:
        echo_json([to_dict(t) for t in tenants])
    else:
        table([_tenant_row(t) for t in tenants], TENANT_COLS)


@tenant_app.command("show")
def tenant_show(ctx: typer.Context, tenant_id: str, as_json: JsonOpt = False) -> None:
    """A tenant's limits, and its live state (bucket, quota used, in flight)
    when a server is named; "state" is null without one."""
    from burstgate_client.admin import apb

    with _tenants(ctx) as c:
        tenant = c.call("GetTenant", apb.GetTenantRequest(tenant_id=tenant_id))
        state = c.call("GetTenantState", apb.GetTenantStateRequest(tenant_id=tenant_id))
    if as_json:
        echo_json({"tenant": to_dict(tenant), "state": None if state is None else to_dict(state)})
        return
    kv(_tenant_row(tenant))
    if state is None:
        return
    typer.echo("")
    live = to_dict(state)
    live.pop("tenant_id", None)
    shown = {k: live.get(k, 0) for k in (
        "bucket_tokens", "burst_tokens", "hourly_used_tokens", "hourly_quota",
        "daily_used_tokens", "daily_quota", "in_flight_requests", "in_flight_tokens",
        "queued_requests", "as_of",
    )}  # fmt: skip
    for k in ("hourly_quota", "daily_quota"):
        if str(shown[k]) == "-1":
            shown[k] = "unlimited"
    kv(shown)


def _print_tenant(t: Any, as_json: bool, verb: str) -> None:
    if as_json:
        echo_json(to_dict(t))
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
PoolOpt = Annotated[
    str | None, typer.Option(help="Engine pool of requests that name none (default: the lane's).")
]
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
        given, v = parse_limit(value, "--" + name.replace("_", "-"))
        if given:
            fields[name] = v
    return fields


def _update(ctx: typer.Context, tenant_id: str, fields: dict[str, Any], as_json: bool) -> None:
    from burstgate_client.admin import apb
    from google.protobuf.field_mask_pb2 import FieldMask

    if not fields:
        fail("nothing to change: give at least one option (see --help)")
    t = apb.Tenant(tenant_id=tenant_id)
    for name, value in fields.items():
        if value is not None:
            setattr(t, name, value)
    with _tenants(ctx) as c:
        updated = c.call(
            "UpdateTenant",
            apb.UpdateTenantRequest(tenant=t, update_mask=FieldMask(paths=list(fields))),
        )
    if as_json:
        echo_json(to_dict(updated))
    else:
        shown = [
            f"{k}={cell(getattr(updated, k))}"
            if k in _PLAIN or updated.HasField(k)
            else f"{k}=unlimited"
            if k in LIMIT_FIELDS
            else f"{k}=-"  # cleared: not configured (max_wait_ms, fallback_model, pool ...)
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
    pool: PoolOpt = None,
    shadow_mode: Annotated[bool, typer.Option("--shadow-mode/--no-shadow-mode")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create a tenant."""
    from burstgate_client.admin import apb

    fields = _limit_fields(rate, burst, hourly_quota, daily_quota, max_concurrency, max_queued,
                           max_tokens_per_request, dedicated_quota)  # fmt: skip
    t = apb.Tenant(tenant_id=tenant_id, default_lane=default_lane, display_name=display_name,
                   shadow_mode=shadow_mode)  # fmt: skip
    if fallback_model is not None:
        t.fallback_model = fallback_model
    if pool is not None:
        t.pool = pool
    for name, value in fields.items():
        if value is not None:
            setattr(t, name, value)
    with _tenants(ctx) as c:
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
    pool: Annotated[
        str | None,
        typer.Option(help="Engine pool of requests that name none, or 'none' (= the lane's)."),
    ] = None,
    shadow_mode: ShadowOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a tenant's settings other than limits (see `tenant limits`)."""
    fields: dict[str, Any] = {}
    if display_name is not None:
        fields["display_name"] = display_name
    if default_lane is not None:
        fields["default_lane"] = default_lane
    if fallback_model is not None:
        fields["fallback_model"] = None if fallback_model.lower() in UNLIMITED else fallback_model
    for name, value in (("max_wait_ms", max_wait_ms), ("long_request_tokens", long_request_tokens)):
        given, v = parse_limit(value, "--" + name.replace("_", "-"))
        if given:
            fields[name] = v
    if demote_long_requests is not None:
        fields["demote_long_requests"] = demote_long_requests
    if pool is not None:
        fields["pool"] = None if pool.lower() in UNLIMITED else pool
    if shadow_mode is not None:
        fields["shadow_mode"] = shadow_mode
    _update(ctx, tenant_id, fields, as_json)


@tenant_app.command("limits")
def tenant_limits(
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
    from burstgate_client.admin import apb

    with _tenants(ctx) as c:
        t = c.call("DisableTenant", apb.DisableTenantRequest(tenant_id=tenant_id))
    _print_tenant(t, as_json, "disabled")


@tenant_app.command("enable")
def tenant_enable(ctx: typer.Context, tenant_id: str, as_json: JsonOpt = False) -> None:
    """Admit the tenant's requests again."""
    from burstgate_client.admin import apb

    with _tenants(ctx) as c:
        t = c.call("EnableTenant", apb.EnableTenantRequest(tenant_id=tenant_id))
    _print_tenant(t, as_json, "enabled")


@tenant_app.command("delete")
def tenant_delete(
    ctx: typer.Context,
    tenant_id: str,
    force: Annotated[bool, typer.Option(help="Delete even with unsettled reservations.")] = False,
) -> None:
    """Delete a tenant (refused while it has unsettled reservations, unless --force)."""
    from burstgate_client.admin import apb

    with _tenants(ctx) as c:
        r = c.call("DeleteTenant", apb.DeleteTenantRequest(tenant_id=tenant_id, force=force))
    typer.echo(f"tenant {tenant_id} deleted ({r.open_reservations} unsettled reservations)")
