"""The CLI's first-hour paths against a real server (issue 35): connection
options after the command (the later one wins), int64 fields as JSON
numbers, and the widest listings at 80 columns."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import subprocess
import sys

from typer.testing import CliRunner

from controlplane.cli import app
from tests.integration.admin.conftest import Env
from tests.integration.admin.test_cli_admin import server_logs_elsewhere

__all__ = ["server_logs_elsewhere"]  # the autouse fixture, shared


def test_connection_options_after_the_command_and_the_later_wins(env: Env) -> None:
    runner = CliRunner()
    key = env.keys.admin
    after = runner.invoke(app, ["tenant", "list", "--target", env.target, "--api-key", key,
                                "--json"], env={"BURSTGATE_ADMIN_TARGET": None})  # fmt: skip
    assert after.exit_code == 0, after.output
    tenants = json.loads(after.stdout)
    assert [t["tenant_id"] for t in tenants] == ["acme", "beta"]
    # int64 fields are numbers, like the int32 ones beside them
    assert tenants[0]["burst_tokens"] == 10_000 and tenants[0]["hourly_quota"] == 1_000_000
    assert tenants[0]["max_concurrency"] == 50
    # before and after: the one after the command wins (a dead port before it)
    both = runner.invoke(app, ["admin", "--target", "127.0.0.1:1", "--api-key", "wrong", "lane",
                               "list", "--target", env.target, "--api-key", key])  # fmt: skip
    assert both.exit_code == 0, both.output
    assert both.stdout.split()[0] == "name"
    # ... and one after the command overrides the environment variable
    env_var = runner.invoke(app, ["pools", "status", "--target", env.target, "--json"],
                            env={"BURSTGATE_ADMIN_TARGET": "127.0.0.1:1",
                                 "BURSTGATE_API_KEY": key})  # fmt: skip
    assert env_var.exit_code == 0, env_var.output


def _on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """The real ``burstgate`` on a pseudo-terminal: what an operator sees."""
    main, child = pty.openpty()
    proc = subprocess.run([sys.executable, "-m", "controlplane", *args], stdout=child,
                          stderr=subprocess.PIPE, env={**os.environ, **env, "NO_COLOR": "1"},
                          timeout=60, check=False)  # fmt: skip
    os.close(child)
    out = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(main, 65536):
            out += chunk
    os.close(main)
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode()).replace("\r\n", "\n")
    return text


def test_the_widest_listing_fits_80_columns_on_a_terminal(env: Env) -> None:
    vars_ = {"BURSTGATE_ADMIN_TARGET": env.target, "BURSTGATE_API_KEY": env.keys.admin}
    piped = CliRunner().invoke(app, ["tenant", "list"], env=vars_ | {"COLUMNS": "80"})
    assert max(len(line) for line in piped.stdout.splitlines()) > 80  # a pipe: one row a line
    shown = _on_a_terminal(["tenant", "list"], vars_ | {"COLUMNS": "80"})
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    # plain text: one "column  value" block per row, the same values
    blocks = [b.splitlines() for b in shown.strip().split("\n\n")]
    assert [b[0].split() for b in blocks] == [["tenant_id", "acme"], ["tenant_id", "beta"]]
    assert blocks[0][1].split() == ["enabled", "yes"]
