"""``burstgate config export | apply | check``: the declarative YAML config
(lanes, tenants, policy overrides), on the database directly like
``burstgate keys``; ``check`` reports what the live config leaves unpriced.

``export`` prints the live configuration as a file ``apply`` accepts;
``apply --dry-run`` prints what ``apply`` would change and writes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.cli.common import DbOpt, fail, settings
from controlplane.cli.render import cell

config_app = typer.Typer(
    help="Declarative YAML config (lanes, tenants, policy overrides).", no_args_is_help=True
)


@contextlib.contextmanager
def _repo(database_url: str | None) -> Iterator[tuple[Any, Any]]:
    """The repository and the settings (whose policy is the base of overrides)."""
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine

    conf = settings(database_url=database_url)
    engine = make_engine(conf.database_url)
    try:
        yield ConfigRepository(engine), conf
    finally:
        engine.dispose()


@config_app.command("export")
def config_export(
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file (default: stdout).")
    ] = None,
    database_url: DbOpt = None,
) -> None:
    """Print the live configuration as YAML that `burstgate config apply` accepts."""
    from controlplane import configfile

    with _repo(database_url) as (repo, _):
        cfg = configfile.export(repo)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = configfile.dump(cfg, header=f"# burstgate config export, {stamp}\n")
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.write_text(text)
    except OSError as exc:
        fail(f"--out: cannot write {out}: {exc.strerror or exc}")
    typer.echo(
        f"{len(cfg.lanes)} lanes, {len(cfg.tenants)} tenants, "
        f"{len(cfg.policy)} policy overrides -> {out}",
        err=True,
    )


@config_app.command("apply")
def config_apply(
    path: Annotated[Path, typer.Argument(help="YAML file with lanes/tenants/policy; - = stdin.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would change; write nothing.")
    ] = False,
    database_url: DbOpt = None,
) -> None:
    """Create or update the lanes, tenants and policy keys in a YAML file.

    Every lane and tenant in the file gets all its settings from the file (a
    field left out takes its default); entries not in the file are left as
    they are. The file is validated in full before anything is written."""
    from controlplane import configfile

    cfg = configfile.load(path)
    with _repo(database_url) as (repo, conf):
        changes = configfile.diff(repo, cfg, conf.policy)
        _print_changes(changes)
        if dry_run:
            typer.echo("dry run: nothing written")
            return
        created, updated = configfile.apply(repo, cfg, base_policy=conf.policy)
    typer.echo(f"{created} tenants created, {updated} updated")


def _print_changes(changes: Sequence[Any]) -> None:
    if not changes:
        typer.echo("no changes")
        return
    for c in changes:
        what = f"{c.kind} {c.name}" if c.name else c.kind
        if c.action == "create":
            typer.echo(f"+ {what}")
            continue
        shown = ", ".join(f"{k}: {_value(b)} -> {_value(a)}" for k, (b, a) in c.fields.items())
        typer.echo(f"~ {what}: {shown}")
    created = sum(c.action == "create" for c in changes)
    typer.echo(f"{len(changes)} to change: {created} created, {len(changes) - created} updated")


def _value(v: Any) -> str:
    # A limit or option that is not set reads "unset" here, an empty text
    # "": "-" would be ambiguous inside a "before -> after" pair.
    if v is None:
        return "unset"
    if v == "":
        return '""'
    if isinstance(v, Decimal):
        return format(v.normalize(), "f")
    return cell(v)


@config_app.command("check")
def config_check(database_url: DbOpt = None) -> None:
    """Report what the live configuration leaves unsafe for billing: a price
    catalog that leaves tenants or models unpriced (booked at 0, or refused
    with BURSTGATE_LEDGER_UNPRICED=refuse). Exit 1 with a finding per line,
    0 and "ok" when there is none."""
    from controlplane.domain.catalog import PriceCatalog, pricing_gaps
    from controlplane.store.ledger import LedgerStore

    with _repo(database_url) as (repo, conf):
        tenants = [t.tenant_id for t in repo.tenants()]
        catalog = PriceCatalog(LedgerStore(repo.engine).load_catalog())
    findings = pricing_gaps(catalog, tenants)
    if not findings:
        typer.echo(f"ok: {len(tenants)} tenants, {len(catalog)} prices; every request is priced")
        return
    for f in findings:
        typer.echo(f"finding: {f}")
    then = "refused at Admit" if conf.ledger_unpriced == "refuse" else "booked at 0"
    typer.echo(f"(unpriced requests are {then}: BURSTGATE_LEDGER_UNPRICED={conf.ledger_unpriced})")
    raise typer.Exit(1)
