"""One `burstgate serve` per SQLite database (controlplane/store/replica_lock.py);
several on PostgreSQL, sharing cells (docs/ha.md).

Real processes on a real database (SQLite and PostgreSQL, via ``migrated_url``).
SQLite: a second `serve` (or `demo`) on the same database exits at once with
status 3 and one record naming the database and what to do, and binds
nothing; the first keeps serving; the CLI's database commands run beside it;
after the first is stopped with SIGTERM, a new one starts. PostgreSQL: a
second `serve` starts, both are members, no advisory lock is taken, Admit is
decided by the owner wherever the client starts, and after a SIGTERM the
other replica decides.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from burstgate_client.protoclient import ProtoClient, pb
from sqlalchemy.engine import make_url

from controlplane.cli.serve import EXIT_REPLICA_LOCK_HELD
from controlplane.domain import TenantConfig
from tests.integration.test_process import Proc
from tests.support import add_tenants, wait_until

SECRET = "not-a-real-password"


def with_password(url: str) -> str:
    """The URL with a password in it (the test server trusts local
    connections and never asks for it): the refusal must not show it."""
    if not url.startswith("postgresql"):
        return url
    return make_url(url).set(password=SECRET).render_as_string(hide_password=False)


def env_for(url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "BURSTGATE_DATABASE_URL": url,
        "BURSTGATE_PORT": "0",
        "BURSTGATE_METRICS_PORT": "0",
        "BURSTGATE_ADMISSION_AUTH": "false",
        "BURSTGATE_LOG_FORMAT": "json",
        # a spool of its own per process (its default path is per port)
        "BURSTGATE_LEDGER_SPOOL_DIR": str(tmp_path / f"spool-{time.monotonic_ns()}"),
    }


def burstgate(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def stop(proc: Proc) -> None:
    proc.p.send_signal(signal.SIGTERM)
    assert proc.p.wait(timeout=60) == 0
    assert proc.p.stdout is not None
    proc.p.stdout.read()
    proc.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait(timeout=30)
        proc.close()


def admitted(target: str, request_id: str) -> bool:
    with ProtoClient(target) as c:
        d = c.admit("acme", request_id, prompt_tokens=10, max_tokens=10)
        return bool(d.decision == pb.DECISION_ADMIT)


def test_a_second_serve_is_refused_on_sqlite_and_shares_cells_on_postgres(
    migrated_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 10_000))
    url = with_password(migrated_url)
    first = Proc(["serve"], env_for(url, tmp_path))
    procs.append(first)
    assert admitted(first.target, "r1")
    if migrated_url.startswith("postgresql"):
        shares_cells(first, url, tmp_path, procs)
        return

    for args in (["serve"], ["serve", "--migrate"], ["demo", "--port", "0"]):
        second = burstgate(args, env_for(url, tmp_path))
        assert second.returncode == EXIT_REPLICA_LOCK_HELD, second.stderr
        out = second.stdout + second.stderr
        assert "burstgate listening" not in out  # nothing was bound
        assert "demo config" not in out  # refused before the demo wrote its tenants
        # one JSON record (the logs are JSON), as every start-up failure
        [line] = second.stderr.splitlines()
        record = json.loads(line)
        assert (record["event"], record["exit_code"]) == ("start-up failed", 3)
        assert record["reason"] == "replica_lock_held"
        said = record["error"] + " " + record["fix"]
        assert said.startswith("another `burstgate serve` is running on database ")
        assert "several replicas need PostgreSQL" in said
        assert "docs/operating.md" in said
        shown = make_url(url).render_as_string(hide_password=True)
        assert shown in said
        assert f"{make_url(url).database}.serve.lock" in said

    # the first keeps serving, and the CLI's database commands run beside it
    assert admitted(first.target, "r2")
    listed = burstgate(["tenant", "list"], env_for(url, tmp_path))
    assert listed.returncode == 0 and "acme" in listed.stdout, listed.stderr
    keys = burstgate(["keys", "list"], env_for(url, tmp_path))
    assert keys.returncode == 0, keys.stderr
    metrics = urllib.request.urlopen(first.metrics_url, timeout=10).read().decode()
    assert "burstgate_ha_cells_owned 1.0" in metrics  # one replica: every cell

    stop(first)
    third = Proc(["serve"], env_for(url, tmp_path))
    procs.append(third)
    assert admitted(third.target, "r3")
    stop(third)


def shares_cells(first: Proc, url: str, tmp_path: Path, procs: list[Proc]) -> None:
    """PostgreSQL: a second serve starts beside the first (no advisory lock
    is taken), both are members, and the "default" cell's owner decides
    wherever the client starts; after a SIGTERM the other one owns it."""
    ha = {"BURSTGATE_HA_LEASE_TTL_S": "1.5", "BURSTGATE_HA_MARGIN_S": "0.3"}
    env = env_for(url, tmp_path) | ha
    second = Proc(["serve"], env)
    procs.append(second)
    with psycopg.connect(make_url(url).set(password=None).render_as_string(False)) as conn:
        assert lock_holder(conn) is None
    with ProtoClient([second.target, first.target]) as c:
        members = wait_until(
            lambda: list(m) if len(m := c.cell_owners().members) == 2 else None,
            message="both replicas to be members",
        )
        assert sorted(m.address.rsplit(":", 1)[1] for m in members) == sorted(
            p.target.rsplit(":", 1)[1] for p in (first, second)
        )
        for i in range(3):
            d = c.admit("acme", f"shared-{i}", prompt_tokens=10, max_tokens=10)
            assert d.decision == pb.DECISION_ADMIT
    def scrape() -> str:
        body: bytes = urllib.request.urlopen(second.metrics_url, timeout=10).read()
        return body.decode()

    # the gauge reads the replica's own snapshot of the members (one tick old at most)
    metrics = wait_until(lambda: m if "burstgate_ha_members_live 2.0" in (m := scrape()) else None,
                         message="the second replica to count two members")  # fmt: skip
    assert "burstgate_replica_lock" not in metrics
    stop(first)  # drains: the default cell moves to the second
    assert admitted(second.target, "after-stop")
    stop(second)


# --- PostgreSQL: no advisory lock -------------------------------------------------


def lock_holder(conn: psycopg.Connection[Any]) -> int | None:
    """The session holding the advisory lock the one-replica guard of old
    took (its key: the first 8 bytes of SHA-256("burstgate.serve"))."""
    key = int.from_bytes(hashlib.sha256(b"burstgate.serve").digest()[:8], "big", signed=True)
    row = conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        [(key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF],
    ).fetchone()
    return None if row is None else int(row[0])
