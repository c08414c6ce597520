"""One `burstgate serve` per database (controlplane/store/replica_lock.py).

Real processes on a real database (SQLite and PostgreSQL, via ``migrated_url``):
a second `serve` (or `demo`) on the same database exits at once with status 3
and one record naming the database (password hidden) and what to do, and binds
nothing; the first keeps serving; the CLI's database commands run beside it;
after the first is stopped with SIGTERM, a new one starts. In process, on
PostgreSQL: a lock session that dies is replaced at the next config poll, and a
lock taken by someone else meanwhile turns the server's health NOT_SERVING
until it is given back.
"""

from __future__ import annotations

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
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import make_url

from controlplane.cli.serve import EXIT_REPLICA_LOCK_HELD
from controlplane.client import AdmissionClient, pb
from controlplane.domain import TenantConfig
from controlplane.rpc.assembly import ADMISSION_SERVICE
from controlplane.settings import Settings
from controlplane.store.replica_lock import LOCK_KEY
from tests.conftest import ServerThread
from tests.integration.test_process import Proc
from tests.support import add_tenants

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
    with AdmissionClient(target) as c:
        d = c.admit("acme", request_id, prompt_tokens=10, max_tokens=10)
        return bool(d.decision == pb.DECISION_ADMIT)


def test_a_second_serve_on_the_same_database_is_refused(
    migrated_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 10_000))
    url = with_password(migrated_url)
    first = Proc(["serve"], env_for(url, tmp_path))
    procs.append(first)
    assert admitted(first.target, "r1")

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
        assert "scale-out is not supported yet" in said
        assert "docs/operating.md" in said
        assert SECRET not in out
        shown = make_url(url).render_as_string(hide_password=True)
        assert shown in said
        if migrated_url.startswith("postgresql"):
            assert "***" in shown
            assert "application 'burstgate serve " in said  # the holder, named
        else:
            assert f"{make_url(url).database}.serve.lock" in said

    # the first keeps serving, and the CLI's database commands run beside it
    assert admitted(first.target, "r2")
    listed = burstgate(["tenant", "list"], env_for(url, tmp_path))
    assert listed.returncode == 0 and "acme" in listed.stdout, listed.stderr
    keys = burstgate(["keys", "list"], env_for(url, tmp_path))
    assert keys.returncode == 0, keys.stderr
    metrics = urllib.request.urlopen(first.metrics_url, timeout=10).read().decode()
    assert "burstgate_replica_lock_held 1.0" in metrics

    stop(first)
    third = Proc(["serve"], env_for(url, tmp_path))
    procs.append(third)
    assert admitted(third.target, "r3")
    stop(third)


# --- losing the lock while serving (PostgreSQL) ----------------------------------


def lock_holder(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        [(LOCK_KEY >> 32) & 0xFFFFFFFF, LOCK_KEY & 0xFFFFFFFF],
    ).fetchone()
    return None if row is None else int(row[0])


def health(target: str, service: str) -> int:
    import grpc

    with grpc.insecure_channel(target) as ch:
        status: int = (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            .status
        )
        return status


def test_a_lost_lock_is_taken_again_or_reported_not_serving(pg_url: str) -> None:
    from controlplane.store.db import upgrade

    upgrade(pg_url)
    add_tenants(pg_url, TenantConfig("acme", Decimal(1000), 10_000))
    settings = Settings(
        database_url=pg_url, host="127.0.0.1", port=0, metrics_port=-1,
        admission_auth=False, config_poll_s=600,  # polled by hand below
    )  # fmt: skip
    srv = ServerThread(settings, time.time_ns)
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    try:
        with psycopg.connect(pg_url, autocommit=True) as other:
            first = lock_holder(other)
            assert first is not None and first != other.info.backend_pid
            # 1. the session is killed (a PostgreSQL restart, an operator): the
            #    next poll takes the lock on a new one
            other.execute("SELECT pg_terminate_backend(%s, 5000)", [first])
            srv._run(srv.plane.poll_once())
            second = lock_holder(other)
            assert second is not None and second != first
            assert srv.plane.replica.held and srv.plane.replica.lost_total == 0
            # 2. our side loses its connection while the server keeps the session
            #    (a network cut): the stale session is recognised as ours, ended
            #    and replaced
            lock = srv.plane.replica.lock
            stale = lock._conn
            lock._conn = None
            try:
                srv._run(srv.plane.poll_once())
            finally:
                stale.close()
            third = lock_holder(other)
            assert third is not None and third not in (first, second)
            assert srv.plane.replica.held
            # 3. killed, and another replica takes the lock first: NOT_SERVING
            #    (it keeps answering), the counter moves, and when the other one
            #    gives the lock back it is taken again and SERVING returns
            other.execute("SELECT pg_terminate_backend(%s, 5000)", [third])
            assert other.execute("SELECT pg_try_advisory_lock(%s)", [LOCK_KEY]).fetchone() == (
                True,
            )
            srv._run(srv.plane.poll_once())
            assert not srv.plane.replica.held and srv.plane.replica.lost_total == 1
            assert health(srv.target, "") == not_serving
            assert health(srv.target, ADMISSION_SERVICE) == not_serving
            assert admitted(srv.target, "while-not-serving")
            srv._run(srv.plane.poll_once())  # still taken: still NOT_SERVING, counted once
            assert srv.plane.replica.lost_total == 1
            assert health(srv.target, "") == not_serving
            other.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])
            srv._run(srv.plane.poll_once())
            assert srv.plane.replica.held
            assert health(srv.target, "") == serving
            assert health(srv.target, ADMISSION_SERVICE) == serving
            assert lock_holder(other) not in (None, other.info.backend_pid)
    finally:
        srv.stop()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert lock_holder(conn) is None  # given up at stop
