"""CLI consistency over a real server and database (SQLite and PostgreSQL):
`admin state --watch`, audit diffs that list only what changed, lane
vocabulary, and `config export` / `config apply --dry-run` as a round trip."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from controlplane.cli import app
from tests.integration.admin.conftest import Env
from tests.integration.admin.test_cli_admin import Cli, server_logs_elsewhere

__all__ = ["server_logs_elsewhere"]  # the autouse fixture, shared


def _db(env: Env) -> list[str]:
    return ["--database-url", env.url]


def test_state_watch_refreshes_and_stops_after_count(env: Env) -> None:
    cli = Cli(env, env.keys.admin)
    out = cli("admin", "state", "--watch", "--interval", "0.2", "--count", "3").stdout
    assert out.count("as of ") == 3 and out.count("open_reservations") == 3
    env.admit("acme", "w1")
    lines = cli("admin", "state", "-w", "--interval", "0.2", "--count", "2", "--json")
    objects = [json.loads(line) for line in lines.stdout.splitlines()]
    assert len(objects) == 2 and all("decisions" in o for o in objects)
    # without --watch: one snapshot, no time line
    assert "as of" not in cli("admin", "state").stdout


def test_audit_lists_only_changed_fields(env: Env) -> None:
    cli = Cli(env, env.keys.admin)
    cli("tenant", "limits", "acme", "--rate", "250")
    audit = cli("admin", "audit", "list", "--object", "tenant:acme").stdout.splitlines()
    [line] = [row for row in audit if "tenant.update" in row]
    assert "token_rate: 1000 -> 250" in line
    # burst_tokens, quotas ... did not change: not listed
    assert "burst_tokens" not in line and "hourly_quota" not in line


def test_lane_list_vocabulary(env: Env) -> None:
    cli = Cli(env, env.keys.admin)
    lines = cli("admin", "lane", "list").stdout.splitlines()
    header = lines[0].split()
    rows = {line.split()[0]: dict(zip(header, line.split(), strict=True)) for line in lines[1:]}
    assert rows["premium"]["fail_open"] == "yes" and rows["standard"]["fail_open"] == "no"
    assert rows["batch"]["max_queued"] == "policy"


def test_config_export_apply_round_trip(env: Env, tmp_path: Path) -> None:
    runner = CliRunner()
    exported = runner.invoke(app, ["config", "export", *_db(env)])
    assert exported.exit_code == 0, exported.output
    doc = yaml.safe_load(exported.stdout)
    assert [t["tenant_id"] for t in doc["tenants"]] == ["acme", "beta"]
    assert doc["tenants"][0]["hourly_quota"] == 1_000_000
    path = tmp_path / "live.yaml"
    path.write_text(exported.stdout)
    same = runner.invoke(app, ["config", "apply", "--dry-run", str(path), *_db(env)])
    assert same.exit_code == 0 and same.stdout.splitlines()[0] == "no changes", same.output

    # Edit: a tenant's rate, a new tenant, a lane weight pair, a policy key.
    doc["tenants"][0]["token_rate"] = 1500
    doc["tenants"].append({"tenant_id": "gamma", "token_rate": 5, "burst_tokens": 50})
    weights = {lane["name"]: lane for lane in doc["lanes"]}
    weights["premium"]["weight"], weights["standard"]["weight"] = 0.35, 0.5
    doc["policy"] = {"bp_hard_threshold": 0.9}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    dry = runner.invoke(app, ["config", "apply", "--dry-run", str(path), *_db(env)])
    assert dry.exit_code == 0, dry.output
    lines = dry.stdout.splitlines()
    assert "~ tenant acme: token_rate: 1000 -> 1500" in lines
    assert "+ tenant gamma" in lines
    assert "~ lane premium: weight: 0.4 -> 0.35" in lines
    assert any(line.startswith("~ policy: bp_hard_threshold: ") for line in lines)
    assert lines[-1] == "dry run: nothing written"
    # nothing was written
    again = runner.invoke(app, ["config", "export", *_db(env)])
    assert yaml.safe_load(again.stdout) == yaml.safe_load(exported.stdout)

    applied = runner.invoke(app, ["config", "apply", str(path), *_db(env)])
    assert applied.exit_code == 0 and "1 tenants created, 2 updated" in applied.stdout
    after = yaml.safe_load(runner.invoke(app, ["config", "export", *_db(env)]).stdout)
    assert after == doc  # what was applied is what export gives back
    done = runner.invoke(app, ["config", "apply", "--dry-run", str(path), *_db(env)])
    assert done.stdout.splitlines()[0] == "no changes"


def test_config_apply_refuses_a_bad_file_whole(env: Env, tmp_path: Path) -> None:
    runner = CliRunner()
    before = runner.invoke(app, ["config", "export", *_db(env)]).stdout
    doc = yaml.safe_load(before)
    doc["tenants"][0]["token_rate"] = 7
    doc["policy"] = {"bp_hard_threshold": "high"}  # wrong type
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    for extra in ([], ["--dry-run"]):
        r = runner.invoke(app, ["config", "apply", str(path), *extra, *_db(env)])
        assert r.exit_code == 2 and "policy.bp_hard_threshold" in r.stderr, r.output
    assert (
        runner.invoke(app, ["config", "export", *_db(env)]).stdout.split("\n", 1)[1]
        == (
            before.split("\n", 1)[1]  # the first line is the export's time stamp
        )
    )
    doc["policy"] = {"no_such_key": 1}
    path.write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["config", "apply", str(path), *_db(env)])
    assert r.exit_code == 2 and "policy.no_such_key: unknown policy key" in r.stderr, r.output
