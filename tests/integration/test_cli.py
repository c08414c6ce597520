"""The burstgate command against SQLite and PostgreSQL."""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.store.audit import AuditLog
from controlplane.store.db import make_engine

runner = CliRunner()


def run(*args: str) -> str:
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def audit_rows(url: str, target: str = "") -> list[Any]:
    engine = make_engine(url)
    try:
        return AuditLog(engine).list(100, target=target)[0]
    finally:
        engine.dispose()


def test_migrate_tenants_and_config_apply(db_url: str, tmp_path: Path) -> None:
    # No --target / BURSTGATE_ADMIN_TARGET: `burstgate tenant` writes the database.
    db = ["--database-url", db_url]
    assert "database at head" in run("migrate", *db)
    tenant = ["tenant", *db]
    out = run(*tenant, "add", "acme", "--rate", "1500.5", "--burst", "20000",
              "--hourly-quota", "900000", "--default-lane", "premium")  # fmt: skip
    assert "tenant acme added" in out
    listing = run(*tenant, "list")
    assert listing.split()[:3] == ["tenant_id", "enabled", "token_rate"]
    assert "acme" in listing and "1500.5" in listing and "premium" in listing
    shown = json.loads(run(*tenant, "show", "acme", "--json"))
    assert shown["state"] is None  # live state needs a server
    assert shown["tenant"]["hourly_quota"] == 900000  # int64 as a JSON number (issue 35)
    assert shown["tenant"]["token_rate"] == "1500.5"
    assert "max_concurrency=7" in run(*tenant, "limits", "acme", "--max-concurrency", "7")
    run(*tenant, "update", "acme", "--display-name", "Acme Corp")
    assert "pool=gpu-a" in run(*tenant, "update", "acme", "--pool", "gpu-a")
    assert json.loads(run(*tenant, "show", "acme", "--json"))["tenant"]["pool"] == "gpu-a"
    assert "pool=-" in run(*tenant, "update", "acme", "--pool", "none")  # cleared
    assert "pool" not in json.loads(run(*tenant, "show", "acme", "--json"))["tenant"]
    run(*tenant, "add", "pooled", "--rate", "1", "--burst", "10", "--pool", "gpu-b")
    assert json.loads(run(*tenant, "show", "pooled", "--json"))["tenant"]["pool"] == "gpu-b"
    run(*tenant, "delete", "pooled", "--force")
    run(*tenant, "disable", "acme")
    assert json.loads(run(*tenant, "list", "--json"))[0]["enabled"] is False
    cfg = tmp_path / "tenants.yaml"
    cfg.write_text(
        "tenants:\n"
        "  - {tenant_id: acme, token_rate: 10, burst_tokens: 100}\n"
        "  - {tenant_id: beta, token_rate: 20, burst_tokens: 200, default_lane: batch}\n"
    )
    assert "1 tenants created, 1 updated" in run("config", "apply", str(cfg), *db)
    rows = {t["tenant_id"]: t for t in json.loads(run(*tenant, "list", "--json"))}
    assert rows["acme"]["burst_tokens"] == 100 and rows["beta"]["default_lane"] == "batch"


def test_database_route_writes_the_audit_row(sqlite_url: str, tmp_path: Path) -> None:
    """Every change of the database route is audited as local:<os user>, in the
    same transaction as the change; a refused change writes nothing."""
    db = ["--database-url", sqlite_url]
    run("migrate", *db)
    tenant = ["tenant", *db]
    run(*tenant, "add", "acme", "--rate", "5", "--burst", "50")
    run(*tenant, "limits", "acme", "--burst", "60")
    run(*tenant, "disable", "acme")
    run(*tenant, "enable", "acme")
    bad = runner.invoke(app, [*tenant, "limits", "acme", "--max-concurrency", "3000000000"])
    assert bad.exit_code == 2 and "INVALID_ARGUMENT: max_concurrency" in bad.stderr
    refused = runner.invoke(app, [*tenant, "delete", "acme"])  # unsettled reservations unknown
    assert refused.exit_code == 2 and "FAILED_PRECONDITION" in refused.stderr
    run(*tenant, "delete", "acme", "--force")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tenants:\n  - {tenant_id: beta, token_rate: 1, burst_tokens: 10}\n")
    run("config", "apply", str(cfg), *db)
    events = audit_rows(sqlite_url)
    assert [(e.action, e.target) for e in reversed(events)] == [
        ("tenant.create", "tenant:acme"),
        ("tenant.update", "tenant:acme"),
        ("tenant.disable", "tenant:acme"),
        ("tenant.enable", "tenant:acme"),
        ("tenant.delete", "tenant:acme"),
        ("tenant.create", "tenant:beta"),
    ]
    user = getpass.getuser()
    assert all(e.actor == f"local:{user}" and e.actor_role == "local" for e in events)
    update = next(e for e in events if e.action == "tenant.update")
    assert json.loads(update.before or "") == {"burst_tokens": 50}
    assert json.loads(update.after or "") == {"burst_tokens": 60}


def test_target_and_database_url_are_exclusive(sqlite_url: str) -> None:
    both = runner.invoke(
        app, ["tenant", "--target", "127.0.0.1:1", "--database-url", sqlite_url, "list"]
    )
    assert both.exit_code == 2 and "not both" in both.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_input_exits_2_with_a_message_naming_the_field(sqlite_url: str, tmp_path: Path) -> None:
    db = ["--database-url", sqlite_url]
    assert _cli("migrate", *db).returncode == 0
    bad_rate = _cli("tenant", *db, "add", "x", "--rate", "abc", "--burst", "10")
    assert bad_rate.returncode == 2 and "token_rate" in bad_rate.stderr
    bad_lane = _cli(
        "tenant", *db, "add", "x", "--rate", "1", "--burst", "10", "--default-lane", "gold"
    )
    assert bad_lane.returncode == 2 and "default_lane" in bad_lane.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tenants:\n  - {tenant_id: a, token_rate: 1, burst_tokens: -4}\n")
    bad_file = _cli("config", "apply", str(cfg), *db)
    assert bad_file.returncode == 2 and "tenants[0].burst_tokens" in bad_file.stderr
    ghost = _cli("tenant", *db, "show", "ghost")
    assert ghost.returncode == 2 and "NOT_FOUND" in ghost.stderr
    listing = _cli("tenant", *db, "list", "--json")
    assert json.loads(listing.stdout) == []  # nothing half-written
    bad_env = subprocess.run(
        [sys.executable, "-m", "controlplane", "tenant", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"BURSTGATE_DATABASE_URL": "mysql://x", "PATH": ""},
    )
    assert bad_env.returncode == 2 and "BURSTGATE_DATABASE_URL" in bad_env.stderr
