"""`burstgate keys ...` (DB-direct) and `burstgate admin ...` (gRPC) against
a running server: the operator session of docs/operating.md, in-process for speed,
plus one run of the real `burstgate` process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from typer.testing import CliRunner

from controlplane.cli import app
from tests.integration.admin.conftest import Env
from tests.support import wait_until


@pytest.fixture(autouse=True)
def server_logs_elsewhere() -> Iterator[io.StringIO]:
    """The server thread logs while CliRunner has swapped sys.stdout: send
    its log lines to a buffer so that they do not mix with the CLI's output."""
    buf = io.StringIO()
    before = structlog.get_config()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buf))
    yield buf
    structlog.configure(**before)


class Cli:
    def __init__(self, env: Env, key: str) -> None:
        self.runner = CliRunner()
        self.env = env
        self.vars = {"BURSTGATE_ADMIN_TARGET": env.target, "BURSTGATE_API_KEY": key}

    def __call__(self, *args: str, code: int = 0, **env: str) -> Any:
        result = self.runner.invoke(app, list(args), env=self.vars | env)
        assert result.exit_code == code, (args, result.stdout, result.stderr, result.exception)
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "--json").stdout)


def runner_code(cli: Cli, *args: str) -> int:
    code: int = cli.runner.invoke(app, list(args), env=cli.vars).exit_code
    return code


@pytest.mark.parametrize("env", [{"config_poll_s": 0.2}], indirect=True)
def test_operator_session(env: Env) -> None:
    db = ("--database-url", env.url)
    boot = CliRunner().invoke(app, ["keys", "create", "--role", "admin", "--name", "ops", *db])
    assert boot.exit_code == 0, boot.stderr
    key = boot.stdout.strip()
    assert key.startswith("bgk_") and "shown only now" in boot.stderr
    cli = Cli(env, key)

    table = cli("tenant", "list").stdout.splitlines()
    assert table[0].split()[:3] == ["tenant_id", "enabled", "token_rate"]
    assert [line.split()[0] for line in table[1:]] == ["acme", "beta"]
    assert [t["tenant_id"] for t in cli.json("tenant", "list")] == ["acme", "beta"]

    out = cli("tenant", "add", "gamma", "--rate", "10", "--burst", "100",
              "--hourly-quota", "5000").stdout  # fmt: skip
    assert "tenant gamma added" in out
    out = cli("tenant", "limits", "gamma", "--rate", "20", "--burst", "400",
              "--hourly-quota", "unlimited").stdout  # fmt: skip
    assert "token_rate=20, burst_tokens=400, hourly_quota=unlimited" in out
    # The level is kept (100 of the old burst); it refills towards the new one.
    assert env.admit("gamma", "r1", prompt=60).decision == pb.DECISION_ADMIT
    shown = cli.json("tenant", "show", "gamma")
    assert shown["tenant"]["burst_tokens"] == 400  # int64 as a JSON number, as every integer
    assert "hourly_quota" not in shown["tenant"]
    assert shown["state"]["in_flight_tokens"] == 60
    human = cli("tenant", "show", "gamma").stdout
    assert "hourly_quota" in human and "unlimited" in human and "bucket_tokens" in human

    cli("tenant", "update", "gamma", "--default-lane", "batch", "--shadow-mode")
    assert cli.json("tenant", "show", "gamma")["tenant"]["default_lane"] == "batch"
    assert "disabled" in cli("tenant", "disable", "gamma").stdout
    assert env.admit("gamma", "r2").reason == pb.REASON_TENANT_DISABLED
    cli("tenant", "enable", "gamma")

    bad = cli("tenant", "limits", "gamma", "--burst", "0", code=2)
    assert "INVALID_ARGUMENT: burst_tokens" in bad.stderr
    assert "nothing to change" in cli("tenant", "limits", "gamma", code=2).stderr
    assert "not an integer" in cli("tenant", "limits", "gamma", "--daily-quota", "lots",
                                   code=2).stderr  # fmt: skip

    audit = cli("admin", "audit", "list", "--object", "tenant:gamma").stdout.splitlines()
    assert audit[0].split() == ["id", "time", "actor", "action", "target", "change"]
    assert "tenant.enable" in audit[1] and "tenant.create" in audit[-1]
    assert any("token_rate: 10 -> 20" in line for line in audit)
    events = cli.json("admin", "audit", "list", "--limit", "2")
    assert len(events) == 2 and events[0]["actor"].startswith("key:")

    policy = cli.json("admin", "policy", "set", "bp_hard_threshold=0.9", "stale_policy=fail_closed")
    assert policy["bp_hard_threshold"] == 0.9 and policy["stale_policy"] == "fail_closed"
    assert "fail_closed" in cli("admin", "policy", "show").stdout
    assert cli.json("admin", "policy", "reset", "bp_hard_threshold")["bp_hard_threshold"] == 0.85
    assert "bp_alpha" in cli("admin", "policy", "set", "bp_alpha=0.9", code=2).stderr

    assert "premium" in cli("admin", "lane", "list").stdout
    assert "wait_target_ms=6000" in cli("admin", "lane", "set", "batch", "--wait-target-ms",
                                         "6000").stdout  # fmt: skip
    state = cli.json("admin", "state")
    assert state["tenants"] == 3 and state["decisions"]
    assert "decision" in cli("admin", "state").stdout

    sidecar = cli("admin", "keys", "create", "--role", "sidecar", "--name", "pool-a",
                  "--tenant", "acme", "--tenant", "team-*", "--pool", "pool-a",
                  "--expires-in", "30d")  # fmt: skip
    sidecar_key = sidecar.stdout.strip()
    sidecar_id = sidecar_key.split("_")[1]
    listing = cli("admin", "keys", "list").stdout.splitlines()
    assert listing[0].split()[:7] == [
        "key_id", "name", "role", "tenants", "pools", "expires", "last_used",
    ]  # fmt: skip
    [row] = [line.split() for line in listing if line.startswith(sidecar_id)]
    assert row[1:5] == ["pool-a", "sidecar", "acme,team-*", "pool-a"]
    # A sidecar key must say what it serves; bad values name the option.
    no_scope = cli("admin", "keys", "create", "--role", "sidecar", "--name", "x", code=2)
    assert "INVALID_ARGUMENT: tenants: a sidecar key must name the tenants" in no_scope.stderr
    bad_ttl = cli("admin", "keys", "create", "--role", "admin", "--name", "x",
                  "--expires-in", "soon", code=2)  # fmt: skip
    assert "--expires-in: 'soon' is not a duration" in bad_ttl.stderr
    assert f"key {sidecar_id} revoked" in cli("admin", "keys", "revoke", sidecar_id).stdout
    listed = CliRunner().invoke(app, ["keys", "list", "--all", "--json", *db])
    revoked = [k for k in json.loads(listed.stdout) if k["key_id"] == sidecar_id]
    assert revoked and revoked[0]["revoked"]
    assert (revoked[0]["tenants"], revoked[0]["pools"]) == (["acme", "team-*"], ["pool-a"])
    assert revoked[0]["expires"]
    out = cli("tenant", "delete", "gamma", code=2)
    assert "FAILED_PRECONDITION" in out.stderr and "unsettled" in out.stderr
    assert "deleted" in cli("tenant", "delete", "gamma", "--force").stdout

    # Credentials: missing, wrong, revoked (DB-direct), viewer writing.
    assert "no API key" in cli("tenant", "list", code=2, BURSTGATE_API_KEY="").stderr
    wrong = cli("tenant", "list", code=2, BURSTGATE_API_KEY=key[:-3] + "xyz")
    assert "UNAUTHENTICATED" in wrong.stderr
    viewer = cli("tenant", "disable", "acme", code=2, BURSTGATE_API_KEY=env.keys.viewer)
    assert "PERMISSION_DENIED" in viewer.stderr
    ops_id = key.split("_")[1]
    done = CliRunner().invoke(app, ["keys", "revoke", ops_id, *db])
    assert done.exit_code == 0
    # Revoked by another process: refused once the server's config poll
    # (0.2 s here) has re-read the keys.
    wait_until(
        lambda: runner_code(cli, "tenant", "list") == 2,
        message="the CLI-revoked key to be refused",
        timeout=5,
    )
    assert "UNAUTHENTICATED" in cli("tenant", "list", code=2).stderr
    bad_role = CliRunner().invoke(app, ["keys", "create", "--role", "root", "--name", "x", *db])
    assert bad_role.exit_code == 2 and "role" in bad_role.stderr
    unscoped = CliRunner().invoke(app, ["keys", "create", "--role", "sidecar", "--name", "x",
                                        "--tenant", "acme", *db])  # fmt: skip
    assert unscoped.exit_code == 2 and "pools: a sidecar key must name" in unscoped.stderr
    scoped_admin = CliRunner().invoke(app, ["keys", "create", "--role", "admin", "--name", "x",
                                            "--tenant", "acme", *db])  # fmt: skip
    assert scoped_admin.exit_code == 2 and "tenants: only sidecar keys" in scoped_admin.stderr


def test_the_real_command(env: Env) -> None:
    run_env = {**os.environ, "BURSTGATE_ADMIN_TARGET": env.target}
    boot = subprocess.run(
        [sys.executable, "-m", "controlplane", "keys", "create", "--role", "viewer",
         "--name", "proc", "--database-url", env.url],
        capture_output=True, text=True, timeout=60, env=run_env, check=True,
    )  # fmt: skip
    run_env["BURSTGATE_API_KEY"] = boot.stdout.strip()
    listed = subprocess.run(
        [sys.executable, "-m", "controlplane", "tenant", "list"],
        capture_output=True, text=True, timeout=60, env=run_env, check=True,
    )  # fmt: skip
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == ["acme", "beta"]
