"""Start-up failures of the real `burstgate serve`, `demo` and `migrate`
processes (controlplane/startup): each known one is a single line on stderr
(one JSON record with BURSTGATE_LOG_FORMAT=json) naming the cause and the
option, variable or command that fixes it, with its documented exit status
(docs/operating.md, "Start-up failures"), and leaves the file system as it found it.

Each case starts a process (about a second each); PostgreSQL cases use the
local server (a closed port, a database or role that does not exist, a
database of their own at some schema revision)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from controlplane.startup.errors import Exit
from controlplane.store.db import upgrade
from tests.support import free_port

SECRET = "not-a-real-password"
BASE_ENV = {
    "BURSTGATE_PORT": "0",
    "BURSTGATE_METRICS_PORT": "-1",
    "BURSTGATE_ADMISSION_AUTH": "false",
    "BURSTGATE_DB_CONNECT_TIMEOUT_S": "2",
}


def burstgate(
    args: list[str], env: Mapping[str, str | None], cwd: Path, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """The CLI as a process, in ``cwd`` (no .env of the repository's), with
    BASE_ENV and ``env`` as its BURSTGATE_* settings (None: unset)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BURSTGATE_")}
    if "BURSTGATE_FASTPATH" in os.environ:
        clean["BURSTGATE_FASTPATH"] = os.environ["BURSTGATE_FASTPATH"]
    merged = {**clean, **BASE_ENV, **env}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "controlplane", *args],
        capture_output=True, text=True, cwd=cwd, timeout=120,
        env={k: v for k, v in merged.items() if v is not None},
    )  # fmt: skip


def one_line(r: subprocess.CompletedProcess[str], code: Exit) -> str:
    """The single stderr line of a failed start with exit status ``code``."""
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), r.stderr
    assert "burstgate listening" not in r.stdout
    return lines[0]


def one_record(r: subprocess.CompletedProcess[str], code: Exit) -> dict[str, Any]:
    """The single JSON record of a failed start (BURSTGATE_LOG_FORMAT=json)."""
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    record: dict[str, Any] = json.loads(lines[0])
    assert (record["event"], record["level"], record["exit_code"]) == (
        "start-up failed", "error", int(code)
    )  # fmt: skip
    return record


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


@pytest.fixture
def migrated_sqlite(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/db/burstgate.db"
    upgrade(url)
    return url


# ------------------------------------------------------------------ settings


def test_invalid_settings_name_the_variable_or_option(work: Path) -> None:
    line = one_line(burstgate(["serve"], {"BURSTGATE_PORT": "abc"}, work), Exit.SETTINGS)
    assert line.startswith("error: BURSTGATE_PORT: ") and "'abc'" in line
    line = one_line(burstgate(["serve", "--port", "70000"], {}, work), Exit.SETTINGS)
    assert line.startswith("error: --port: ") and "65535" in line
    record = one_record(
        burstgate(["serve"], {"BURSTGATE_PORT": "abc", "BURSTGATE_LOG_FORMAT": "json"}, work),
        Exit.SETTINGS,
    )
    assert record["reason"] == "invalid_settings"
    assert record["error"].startswith("BURSTGATE_PORT: ")
    # a bad URL scheme (or driver) is named, its password never quoted
    for url in (f"mysql://u:{SECRET}@db/x", f"postgresql+asyncpg://u:{SECRET}@db/x"):
        r = burstgate(["migrate"], {"BURSTGATE_DATABASE_URL": url}, work)
        line = one_line(r, Exit.SETTINGS)
        assert line.startswith("error: BURSTGATE_DATABASE_URL: ") and SECRET not in line
    line = one_line(burstgate(["serve"], {"BURSTGATE_DATABASE_URL": "sqlite://"}, work),
                    Exit.SETTINGS)  # fmt: skip
    assert "in-memory" in line and "BURSTGATE_DATABASE_URL" in line
    assert tree(work) == set()


# ----------------------------------------------------------------- PostgreSQL


def pg(admin_dsn: str, **parts: Any) -> str:
    return make_url(admin_dsn).set(**parts).render_as_string(hide_password=False)


def test_postgres_unreachable_is_exit_4_for_every_command(pg_admin_dsn: str, work: Path) -> None:
    url = pg(pg_admin_dsn, host="127.0.0.1", port=free_port(), password=SECRET)
    for args in (["serve"], ["demo"], ["migrate"]):
        line = one_line(burstgate(args, {"BURSTGATE_DATABASE_URL": url}, work),
                        Exit.DB_UNREACHABLE)  # fmt: skip
        assert "cannot connect to the database postgresql://" in line
        assert "refused" in line.lower() and "BURSTGATE_DATABASE_URL" in line
        assert SECRET not in line and "***" in line
    record = one_record(
        burstgate(["serve"], {"BURSTGATE_DATABASE_URL": url, "BURSTGATE_LOG_FORMAT": "json"},
                  work),
        Exit.DB_UNREACHABLE,
    )  # fmt: skip
    assert record["reason"] == "database_unreachable"
    assert "BURSTGATE_DATABASE_URL" in record["fix"]
    assert tree(work) == set()


def test_postgres_missing_database_and_unknown_role_are_exit_5(
    pg_admin_dsn: str, work: Path
) -> None:
    name = f"burstgate_absent_{uuid.uuid4().hex[:8]}"
    r = burstgate(["serve"], {"BURSTGATE_DATABASE_URL": pg(pg_admin_dsn, database=name)}, work)
    line = one_line(r, Exit.DB_ACCESS)
    assert f'database "{name}" does not exist' in line and f"`createdb {name}`" in line
    role = f"nobody_{uuid.uuid4().hex[:8]}"
    url = pg(pg_admin_dsn, username=role, password=SECRET)
    for args in (["serve"], ["migrate"]):
        line = one_line(burstgate(args, {"BURSTGATE_DATABASE_URL": url}, work), Exit.DB_ACCESS)
        assert "refused the login" in line and f'role "{role}" does not exist' in line
        assert "BURSTGATE_DATABASE_URL" in line and SECRET not in line


@pytest.fixture
def pg_empty(pg_admin_dsn: str) -> Iterator[str]:
    """A PostgreSQL database of its own, never migrated."""
    name = f"burstgate_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg(pg_admin_dsn, database=name)
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_postgres_never_migrated_says_burstgate_migrate(pg_empty: str, work: Path) -> None:
    env = {"BURSTGATE_DATABASE_URL": pg_empty}
    line = one_line(burstgate(["serve"], env, work), Exit.SCHEMA)
    assert "has no burstgate schema" in line and "`burstgate migrate`" in line
    record = one_record(burstgate(["serve"], {**env, "BURSTGATE_LOG_FORMAT": "json"}, work),
                        Exit.SCHEMA)  # fmt: skip
    assert record["reason"] == "schema_missing" and "`burstgate migrate`" in record["fix"]
    assert burstgate(["migrate"], env, work).returncode == 0


# ------------------------------------------------------- schema, both backends


def set_revision(url: str, revision: str) -> None:
    from sqlalchemy import text

    from controlplane.store.db import make_engine

    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_schema_older_or_newer_than_the_code(db_url: str, work: Path) -> None:
    from controlplane.store.db import code_heads

    [head] = code_heads()[0]  # the newest migration: the message names it
    env = {"BURSTGATE_DATABASE_URL": db_url}
    upgrade(db_url, "0005")
    line = one_line(burstgate(["serve"], env, work), Exit.SCHEMA)
    assert f"schema revision 0005, older than this burstgate's {head}" in line
    assert "`burstgate migrate`" in line
    assert burstgate(["migrate"], env, work).returncode == 0
    set_revision(db_url, "9999")  # as if a newer burstgate had migrated it
    for args in (["serve"], ["migrate"], ["demo"]):
        line = one_line(burstgate(args, env, work), Exit.SCHEMA)
        assert f"schema revision 9999, which this burstgate (at {head}) does not know" in line
        assert "never downgrades" in line


# --------------------------------------------------------------------- SQLite


def test_serve_never_creates_a_sqlite_database(tmp_path: Path, work: Path) -> None:
    before = tree(tmp_path)
    url = f"sqlite:///{tmp_path}/missing/dir/burstgate.db"
    line = one_line(burstgate(["serve"], {"BURSTGATE_DATABASE_URL": url}, work), Exit.SCHEMA)
    assert f"no SQLite database at {tmp_path}/missing/dir/burstgate.db" in line
    assert f"(directory {tmp_path}/missing/dir does not exist)" in line
    assert "`burstgate migrate`" in line
    assert tree(tmp_path) == before  # neither the file nor its directory
    # an empty file is a database never migrated; looking at it writes nothing
    empty = tmp_path / "empty.db"
    empty.touch()
    r = burstgate(["serve"], {"BURSTGATE_DATABASE_URL": f"sqlite:///{empty}"}, work)
    assert "has no burstgate schema" in one_line(r, Exit.SCHEMA)
    assert empty.stat().st_size == 0 and tree(tmp_path) == before | {"empty.db"}
    # migrate creates both
    r = burstgate(["migrate"], {"BURSTGATE_DATABASE_URL": url}, work)
    assert r.returncode == 0 and (tmp_path / "missing/dir/burstgate.db").is_file(), r.stderr


def test_a_file_that_is_not_sqlite_is_exit_5(tmp_path: Path, work: Path) -> None:
    bad = tmp_path / "notes.db"
    bad.write_text("these are my notes, not a database\n" * 10)
    for args in (["serve"], ["migrate"]):
        r = burstgate(args, {"BURSTGATE_DATABASE_URL": f"sqlite:///{bad}"}, work)
        assert f"{bad} is not a SQLite database" in one_line(r, Exit.DB_ACCESS)
    assert bad.read_text().startswith("these are my notes")


def unprivileged() -> tuple[str, ...]:
    """A command prefix under which directory modes bind this user: as root,
    drop the capabilities that bypass them."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: modes cannot be made to apply")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")


def test_unwritable_sqlite_directory_is_exit_5(
    migrated_sqlite: str, tmp_path: Path, work: Path
) -> None:
    db_dir = tmp_path / "db"
    before = tree(tmp_path)
    db_dir.chmod(0o555)
    try:
        prefix = unprivileged()
        r = burstgate(["serve"], {"BURSTGATE_DATABASE_URL": migrated_sqlite}, work, prefix)
        line = one_line(r, Exit.DB_ACCESS)
        assert f"the directory {db_dir} of the SQLite database is not writable" in line
        new = f"sqlite:///{db_dir}/sub/new.db"
        for args in (["migrate"], ["demo"]):
            r = burstgate(args, {"BURSTGATE_DATABASE_URL": new}, work, prefix)
            line = one_line(r, Exit.DB_ACCESS)
            assert f"cannot create {db_dir}/sub/new.db: directory {db_dir} is not writable" in line
    finally:
        db_dir.chmod(0o755)
    assert tree(tmp_path) == before


# ------------------------------------------------------------------ listeners


def test_grpc_port_in_use(migrated_sqlite: str, held_port: int, tmp_path: Path, work: Path) -> None:
    before = tree(tmp_path)
    env = {"BURSTGATE_DATABASE_URL": migrated_sqlite, "BURSTGATE_PORT": str(held_port)}
    line = one_line(burstgate(["serve"], env, work), Exit.LISTENER)
    assert f"the gRPC port 127.0.0.1:{held_port} is already in use" in line
    assert "--port / BURSTGATE_PORT" in line
    record = one_record(burstgate(["serve"], {**env, "BURSTGATE_LOG_FORMAT": "json"}, work),
                        Exit.LISTENER)  # fmt: skip
    assert record["reason"] == "grpc_port_in_use" and "BURSTGATE_PORT" in record["fix"]
    # demo checks its ports before it creates (and fills) its database
    demo_url = f"sqlite:///{tmp_path}/demo/demo.db"
    r = burstgate(["demo", "--port", str(held_port)], {"BURSTGATE_DATABASE_URL": demo_url}, work)
    assert "--port / BURSTGATE_PORT" in one_line(r, Exit.LISTENER)
    assert tree(tmp_path) == before  # not even the replica lock file


def test_metrics_port_in_use(migrated_sqlite: str, held_port: int, work: Path) -> None:
    env = {"BURSTGATE_DATABASE_URL": migrated_sqlite, "BURSTGATE_METRICS_PORT": str(held_port)}
    for args in (["serve"], ["demo", "--database-url", migrated_sqlite]):
        line = one_line(burstgate(args, env, work), Exit.LISTENER)
        assert f"the metrics port 127.0.0.1:{held_port} is already in use" in line
        assert "--metrics-port / BURSTGATE_METRICS_PORT" in line and "-1" in line


def test_default_metrics_port_9464_is_named(migrated_sqlite: str, work: Path) -> None:
    """Held here, or by something else on this machine: in use either way."""
    env = {"BURSTGATE_DATABASE_URL": migrated_sqlite, "BURSTGATE_METRICS_PORT": None}
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 9464))
            s.listen()
        except OSError:
            pass  # already taken by another program
        line = one_line(burstgate(["serve"], env, work), Exit.LISTENER)
    assert "127.0.0.1:9464" in line and "BURSTGATE_METRICS_PORT" in line


def test_host_not_of_this_machine(migrated_sqlite: str, work: Path) -> None:
    # 192.0.2.1: TEST-NET-1 (RFC 5737), never a local address
    for args in (["serve", "--host", "192.0.2.1"], ["demo", "--host", "192.0.2.1"]):
        r = burstgate(args, {"BURSTGATE_DATABASE_URL": migrated_sqlite}, work)
        line = one_line(r, Exit.LISTENER)
        assert "192.0.2.1 is not an address of this machine" in line
        assert "--host / BURSTGATE_HOST" in line


INJECT_RACE = """
import controlplane.startup.network as network
network.probe = lambda host, port: None  # as if the port were taken after the check
"""


def test_a_port_taken_after_the_check_still_fails_in_one_line(
    migrated_sqlite: str, held_port: int, tmp_path: Path, work: Path
) -> None:
    """The server's own binds (after the probe) report as the probe does,
    and the process exits cleanly: what the start had begun is stopped. The
    lines logged before (config loaded, grpc core's own) come first."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(INJECT_RACE)
    env = {"BURSTGATE_DATABASE_URL": migrated_sqlite, "PYTHONPATH": str(hooks)}
    r = burstgate(["serve"], {**env, "BURSTGATE_METRICS_PORT": str(held_port)}, work)
    assert r.returncode == Exit.LISTENER, r.stderr
    last = r.stderr.splitlines()[-1]
    assert last == (
        f"error: the metrics port 127.0.0.1:{held_port} is already in use. Stop what holds it, "
        "or choose another port with --metrics-port / BURSTGATE_METRICS_PORT (0 = any free "
        "port), or -1 to turn /metrics off"
    )
    assert "Traceback" not in r.stderr and "burstgate listening" not in r.stdout
    r = burstgate(["serve"], {**env, "BURSTGATE_PORT": str(held_port)}, work)
    assert r.returncode == Exit.LISTENER, r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"error: cannot listen for gRPC on 127.0.0.1:{held_port}")
    assert "--port / BURSTGATE_PORT" in last and "Traceback" not in r.stderr


# ------------------------------------------------------------------------ TLS


def test_tls_files(migrated_sqlite: str, tmp_path: Path, work: Path) -> None:
    env = {"BURSTGATE_DATABASE_URL": migrated_sqlite}
    missing = {"BURSTGATE_TLS_CERT_FILE": str(tmp_path / "nope.pem"),
               "BURSTGATE_TLS_KEY_FILE": str(tmp_path / "nope.key")}  # fmt: skip
    line = one_line(burstgate(["serve"], {**env, **missing}, work), Exit.TLS)
    assert f"{tmp_path}/nope.pem (BURSTGATE_TLS_CERT_FILE) does not exist" in line
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    r = burstgate(["serve"], {**env, **missing, "BURSTGATE_TLS_CERT_FILE": str(junk)}, work)
    assert f"{junk} (BURSTGATE_TLS_CERT_FILE) holds no PEM certificate" in one_line(r, Exit.TLS)
    only_cert = {"BURSTGATE_TLS_CERT_FILE": str(junk)}
    line = one_line(burstgate(["serve"], {**env, **only_cert}, work), Exit.SETTINGS)
    assert "BURSTGATE_TLS_CERT_FILE and BURSTGATE_TLS_KEY_FILE must be set together" in line


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_key_of_another_certificate(migrated_sqlite: str, tmp_path: Path, work: Path) -> None:
    for name in ("a", "b"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.pem", "-days", "1", "-subj", f"/CN={name}"],
            cwd=tmp_path, check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    env = {
        "BURSTGATE_DATABASE_URL": migrated_sqlite,
        "BURSTGATE_TLS_CERT_FILE": str(tmp_path / "a.pem"),
        "BURSTGATE_TLS_KEY_FILE": str(tmp_path / "b.key"),
    }
    line = one_line(burstgate(["serve"], env, work), Exit.TLS)
    assert f"the TLS private key {tmp_path}/b.key is not the key of the certificate" in line


# ------------------------------------------------------------------ unexpected

INJECT_BUG = """
import controlplane.server as server

async def _start(self):
    raise ZeroDivisionError("injected by the test")

server.ControlPlane._start = _start
"""


def test_an_unknown_failure_is_one_line_with_the_debug_hint(
    migrated_sqlite: str, tmp_path: Path, work: Path
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(INJECT_BUG)
    env = {"BURSTGATE_DATABASE_URL": migrated_sqlite, "PYTHONPATH": str(hooks)}
    line = one_line(burstgate(["serve"], env, work), Exit.UNEXPECTED)
    assert "start-up failed: ZeroDivisionError: injected by the test" in line
    assert "BURSTGATE_LOG_LEVEL=debug" in line and "Traceback" not in line
    # at debug level the traceback comes too: above the line, or in the record
    r = burstgate(["serve"], {**env, "BURSTGATE_LOG_LEVEL": "debug"}, work)
    assert r.returncode == Exit.UNEXPECTED
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: start-up failed: ZeroDivisionError")
    r = burstgate(
        ["serve"], {**env, "BURSTGATE_LOG_LEVEL": "debug", "BURSTGATE_LOG_FORMAT": "json"}, work
    )
    records = [json.loads(line) for line in r.stderr.splitlines()]  # every line is JSON
    assert records[-1]["reason"] == "unexpected" and records[-1]["exit_code"] == 1
    assert "ZeroDivisionError: injected by the test" in records[-1]["exception"]
