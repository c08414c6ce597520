"""The burstgate command against SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli import app

runner = CliRunner()


def run(*args: str) -> str:
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_migrate_tenants_and_config_apply(db_url: str, tmp_path: Path) -> None:
    db = ["--database-url", db_url]
    assert "database at head" in run("migrate", *db)
    run(
        "tenant",
        "add",
        "acme",
        "--rate",
        "1500.5",
        "--burst",
        "20000",
        "--hourly-quota",
        "900000",
        "--default-lane",
        "premium",
        *db,
    )
    listing = run("tenant", "list", *db)
    assert "acme" in listing and "1500.500" in listing and "premium" in listing
    shown = json.loads(run("tenant", "show", "acme", *db))
    assert shown["hourly_quota"] == 900000 and shown["token_rate"] == "1500.500"
    run("tenant", "disable", "acme", *db)
    assert json.loads(run("tenant", "list", "--json", *db))[0]["enabled"] is False
    cfg = tmp_path / "tenants.yaml"
    cfg.write_text(
        "tenants:\n"
        "  - {tenant_id: acme, token_rate: 10, burst_tokens: 100}\n"
        "  - {tenant_id: beta, token_rate: 20, burst_tokens: 200, default_lane: batch}\n"
    )
    assert "1 tenants created, 1 updated" in run("config", "apply", str(cfg), *db)
    rows = {t["tenant_id"]: t for t in json.loads(run("tenant", "list", "--json", *db))}
    assert rows["acme"]["burst_tokens"] == 100 and rows["beta"]["default_lane"] == "batch"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_input_exits_2_with_a_message_naming_the_field(sqlite_url: str, tmp_path: Path) -> None:
    db = ["--database-url", sqlite_url]
    assert _cli("migrate", *db).returncode == 0
    bad_rate = _cli("tenant", "add", "x", "--rate", "abc", "--burst", "10", *db)
    assert bad_rate.returncode == 2 and "--rate" in bad_rate.stderr
    bad_lane = _cli(
        "tenant", "add", "x", "--rate", "1", "--burst", "10", "--default-lane", "gold", *db
    )
    assert bad_lane.returncode == 2 and "default_lane" in bad_lane.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tenants:\n  - {tenant_id: a, token_rate: 1, burst_tokens: -4}\n")
    bad_file = _cli("config", "apply", str(cfg), *db)
    assert bad_file.returncode == 2 and "tenants.0.burst_tokens" in bad_file.stderr
    assert _cli("tenant", "show", "ghost", *db).returncode == 2
    listing = _cli("tenant", "list", "--json", *db)
    assert json.loads(listing.stdout) == []  # nothing half-written
    bad_env = subprocess.run(
        [sys.executable, "-m", "controlplane", "tenant", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"BURSTGATE_DATABASE_URL": "mysql://x", "PATH": ""},
    )
    assert bad_env.returncode == 2 and "BURSTGATE_DATABASE_URL" in bad_env.stderr
