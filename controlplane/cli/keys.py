"""``burstgate keys ...``: API keys and sidecar tokens, written to the
database directly (the bootstrap path: works before any key exists)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from controlplane.cli.common import DbOpt, JsonOpt, echo_json, fail
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
from controlplane.cli.render import table
from controlplane.domain.keys import Role

keys_app = typer.Typer(
    help="API keys and sidecar tokens, written to the database directly (the bootstrap "
    "path: works before any key exists). Roles: admin, viewer, sidecar.",
    no_args_is_help=True,
)


@contextmanager
def _key_store(database_url: str | None) -> Iterator[Any]:
    from controlplane.domain.errors import DomainError
    from controlplane.settings import Settings
    from controlplane.store.db import make_engine
    from controlplane.store.keys import KeyStore

    url = database_url or Settings().database_url
    engine = make_engine(url)
    try:
        yield KeyStore(engine)
    except DomainError as exc:
        fail(str(exc))
    finally:
        engine.dispose()


@keys_app.command("create")
def keys_create(
    role: Annotated[Role, typer.Option(case_sensitive=False, help="What the key may do.")],
    name: Annotated[str, typer.Option(help="Who or what uses the key.")],
    tenant: TenantScopeOpt = None,
    pool: PoolScopeOpt = None,
    expires_in: ExpiresInOpt = None,
    database_url: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a key in the database (the bootstrap path); prints it once.
    A sidecar key names the tenants and pools it serves (--tenant, --pool,
    repeatable, glob patterns; '*' = all)."""
    expires_at = expiry_option(expires_in)
    with _key_store(database_url) as store:
        secret, info = store.create_key(
            name, role, tenants=tenant or [], pools=pool or [], expires_at=expires_at
        )
    print_new_key(secret, info.key_id, info.role.value, as_json)


@keys_app.command("list")
def keys_list(
    include_revoked: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
    database_url: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List keys (never the secrets)."""
    with _key_store(database_url) as store:
        keys = store.list(include_revoked=include_revoked)
    views = [KeyView(k.key_id, k.name, k.role.value, k.created_by, fmt_time(k.created_at),
                      fmt_time(k.revoked_at), k.tenants, k.pools, fmt_time(k.expires_at),
                      fmt_time(k.last_used_at))
             for k in keys]  # fmt: skip
    if as_json:
        echo_json(key_rows(views, lists=True))
    else:
        table(key_rows(views), KEY_COLS)


@keys_app.command("revoke")
def keys_revoke(key_id: str, database_url: DbOpt = None) -> None:
    """Revoke a key: admin calls are refused at once, admission calls (and
    open AdmitStreams, at their next batch) within BURSTGATE_CONFIG_POLL_S."""
    with _key_store(database_url) as store:
        store.revoke_key(key_id)
    typer.echo(f"key {key_id} revoked")


@keys_app.command("rotate-signing-key")
def keys_rotate_signing_key(database_url: DbOpt = None) -> None:
    """Rotate the key admissions are signed with (docs/ha.md, "Signed
    admissions"): servers sign with the new one from their next config poll
    and still accept the one before it (tokens of the key before that are
    refused by Reannounce). Not for servers given
    BURSTGATE_ADMISSION_SIGNING_KEY, which ignore the database's keys."""
    from controlplane.settings import Settings
    from controlplane.store.db import make_engine
    from controlplane.store.signing import load_keys, rotate

    engine = make_engine(database_url or Settings().database_url)
    try:
        load_keys(engine)  # (the first generation, when no server made it yet)
        generation = rotate(engine)
    finally:
        engine.dispose()
    typer.echo(f"admission signing key rotated: generation {generation} is current")
