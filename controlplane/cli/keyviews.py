"""Views of API keys shared by ``burstgate keys`` (on the database) and
``burstgate admin keys`` (through the API): the table rows, the scope and
expiry options, and how a new key is printed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import typer

from controlplane.cli.common import echo_json, fail
from controlplane.cli.render import TIME_FORMAT


def key_rows(keys: Sequence[Any], *, lists: bool = False) -> list[dict[str, Any]]:
    """Rows for the table (scopes comma-joined) or, ``lists``, for JSON."""

    def names(v: tuple[str, ...]) -> Any:
        return list(v) if lists else ",".join(v)

    return [{"key_id": k.key_id, "name": k.name, "role": k.role, "tenants": names(k.tenants),
             "pools": names(k.pools), "expires": k.expires, "last_used": k.last_used,
             "created_by": k.created_by, "created": k.created, "revoked": k.revoked}
            for k in keys]  # fmt: skip


class KeyView:
    """A key as the tables show it (from the database or the API)."""

    def __init__(self, key_id: str, name: str, role: str, created_by: str, created: str,
                 revoked: str, tenants: Sequence[str] = (), pools: Sequence[str] = (),
                 expires: str = "", last_used: str = "") -> None:  # fmt: skip
        self.key_id, self.name, self.role = key_id, name, role
        self.created_by, self.created, self.revoked = created_by, created, revoked
        self.tenants, self.pools = tuple(tenants), tuple(pools)
        self.expires, self.last_used = expires, last_used


def fmt_time(dt: Any) -> str:
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


def print_new_key(secret: str, key_id: str, role: str, as_json: bool) -> None:
    if as_json:
        echo_json({"key_id": key_id, "role": role, "key": secret})
        return
    typer.echo(secret)
    typer.echo(
        f"created {role} key {key_id}; the key above is shown only now. "
        "Use it as BURSTGATE_API_KEY (or a sidecar's bearer token).",
        err=True,
    )
