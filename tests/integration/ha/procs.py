"""Process harness for the scale-out acceptance (docs/ha.md, "Acceptance"):
N real ``burstgate serve`` processes on one fresh PostgreSQL database, each
with its own member id, advertise address, gRPC and metrics port, lease
TTL/margin, ledger spool and ownership trace file, and optionally a TcpProxy
of its own in front of PostgreSQL (cutting it cuts that replica's database
link alone).

Faults: ``kill()`` (SIGKILL), ``pause()`` / ``resume()`` (SIGSTOP /
SIGCONT), ``term()`` (SIGTERM, waited for), ``cut()`` / ``restore()`` of the
database link; ``start()`` again restarts a replica on the same ports,
spool directory and member id. Every fault is noted with its
``time.monotonic_ns()`` (``Cluster.events``), on the same clock as the
trace files and the load generator's records.

Robustness: each server runs in its own session (process group), and
``Cluster.close()`` (also on any failure: use it as a context manager)
SIGKILLs every group still alive, closes the proxies and drops the
database.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from tests.integration.ledger.proxy import TcpProxy
from tests.support import free_port

# Every pool the scenarios (scenarios.py: MAIN_POOLS, SPREAD_POOLS, the quota
# and gate pools) send to, declared to each replica (docs/operating.md).
DECLARED_POOLS = [*(f"p{i}" for i in range(6)), *(f"s{i}" for i in range(4)), "q0", "g0"]

REPO_ROOT = Path(__file__).resolve().parents[3]
PG_ADMIN_DSN = os.environ.get(
    "BURSTGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
READY = "burstgate listening on "


def create_database(admin_dsn: str = PG_ADMIN_DSN) -> str:
    name = f"burstgate_ha_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return make_url(admin_dsn).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str, admin_dsn: str = PG_ADMIN_DSN) -> None:
    name = make_url(url).database
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_dsn(url: str) -> str:
    """A SQLAlchemy URL as a plain libpq DSN (psycopg)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def scrape(url: str, timeout: float = 2.0) -> dict[str, float] | None:
    """/metrics samples (``name`` or ``name{labels}``); None when down."""
    try:
        body = urllib.request.urlopen(url, timeout=timeout).read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


@dataclass
class Event:
    at_ns: int
    what: str  # kill | pause | resume | cut | restore | term | start
    member: str
    pid: int = 0


@dataclass
class Replica:
    member: str
    url: str  # the database, direct
    out_dir: Path
    env: dict[str, str]
    proxy: TcpProxy | None = None
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    traces: list[Path] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    # pid -> monotonic ns of its death by SIGKILL (intervals end there at the latest)
    deaths: dict[int, int] = field(default_factory=dict)
    paused: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def _db_url(self) -> str:
        if self.proxy is None:
            return self.url
        return make_url(self.url).set(port=self.proxy.port).render_as_string(hide_password=False)

    def launch(self) -> None:
        """Start the process (``wait_ready`` waits for it to serve)."""
        assert self.pid is None, f"{self.member} is running"
        self.starts += 1
        trace = self.out_dir / f"trace-{self.member}-{self.starts}.jsonl"
        log = self.out_dir / f"{self.member}-{self.starts}.log"
        self.traces.append(trace)
        self.logs.append(log)
        env = {
            **os.environ,
            "BURSTGATE_DATABASE_URL": self._db_url(),
            "BURSTGATE_HOST": "127.0.0.1",
            "BURSTGATE_PORT": str(self.port),
            "BURSTGATE_METRICS_PORT": str(self.metrics_port),
            "BURSTGATE_ADVERTISE_ADDRESS": self.address,
            "BURSTGATE_HA_MEMBER_ID": self.member,
            "BURSTGATE_HA_TRACE_FILE": str(trace),
            "BURSTGATE_LEDGER_SPOOL_DIR": str(self.out_dir / f"spool-{self.member}"),
            "BURSTGATE_ADMISSION_AUTH": "false",
            "BURSTGATE_LOG_FORMAT": "json",
            "BURSTGATE_LOG_LEVEL": "warning",
            # the scenarios' pools and the load generator's, declared
            "BURSTGATE_POLICY__KNOWN_POOLS": json.dumps(DECLARED_POOLS),
            **self.env,
        }
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controlplane", "serve"],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=self.out_dir,
                start_new_session=True,  # its own process group: killpg at the end
            )  # fmt: skip
        self.paused = False

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds until the ready line; RuntimeError when it exits first."""
        assert self.proc is not None
        t0 = time.monotonic()
        log = self.logs[-1]
        while True:
            if READY.encode() in log.read_bytes():
                return time.monotonic() - t0
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                tail = log.read_bytes()[-3000:].decode(errors="replace")
                self.hard_kill()
                raise RuntimeError(f"{self.member} did not start (see {log}):\n{tail}")
            time.sleep(0.05)

    def start(self, timeout: float = 60.0) -> float:
        self.launch()
        return self.wait_ready(timeout)

    def signal(self, sig: int) -> int:
        pid = self.pid
        assert pid is not None, f"{self.member} is not running"
        os.kill(pid, sig)
        return pid

    def kill(self) -> int:
        """kill -9; the process is reaped before this returns."""
        assert self.proc is not None
        pid = self.signal(signal.SIGKILL)
        self.deaths[pid] = time.monotonic_ns()
        self.proc.wait(10)
        self.paused = False
        return pid

    def term(self, timeout: float = 30.0) -> int:
        """SIGTERM (a graceful handoff), waited for; its exit code."""
        assert self.proc is not None
        if self.paused:
            self.resume()
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.hard_kill()
            return -9

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.paused = False

    def cut(self) -> None:
        assert self.proxy is not None, f"{self.member} has no database proxy"
        self.proxy.cut()

    def restore(self) -> None:
        assert self.proxy is not None
        self.proxy.restore()

    def hard_kill(self) -> None:
        """Cleanup: SIGKILL the whole process group, whatever its state."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.pid not in self.deaths:
                self.deaths[proc.pid] = time.monotonic_ns()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def metrics(self) -> dict[str, float] | None:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")


class Cluster:
    """``n`` replicas ``r0``..``r{n-1}`` on a fresh database (migrated; the
    caller adds tenants with ``setup(url)``, before ``start``)."""

    def __init__(
        self, out_dir: Path, n: int = 3, *, ttl_s: float = 5.0, margin_s: float = 1.0,
        proxies: bool = True, env: dict[str, str] | None = None,
        admin_dsn: str = PG_ADMIN_DSN,
    ) -> None:  # fmt: skip
        self.out_dir = out_dir
        self.admin_dsn = admin_dsn
        self.ttl_s, self.margin_s = ttl_s, margin_s
        self.events: list[Event] = []
        self.replicas: list[Replica] = []
        self.url = ""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.url = create_database(admin_dsn)
        try:
            from controlplane.store.db import upgrade

            upgrade(self.url)
            u = make_url(self.url)
            base = {
                "BURSTGATE_HA_LEASE_TTL_S": f"{ttl_s:g}",
                "BURSTGATE_HA_MARGIN_S": f"{margin_s:g}",
                **(env or {}),
            }
            for i in range(n):
                proxy = TcpProxy((u.host or "127.0.0.1", u.port or 5432)) if proxies else None
                self.replicas.append(Replica(f"r{i}", self.url, out_dir, dict(base), proxy))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[i]

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def member_of(self, address: str) -> str:
        for r in self.replicas:
            if r.address == address:
                return r.member
        return ""

    def note(self, what: str, r: Replica, pid: int = 0) -> Event:
        ev = Event(time.monotonic_ns(), what, r.member, pid or (r.pid or 0))
        self.events.append(ev)
        return ev

    def start(self, replicas: Iterable[Replica] | None = None, timeout: float = 90.0) -> None:
        """Start replicas in parallel (launch all, then wait for each)."""
        todo = list(self.replicas if replicas is None else replicas)
        for r in todo:
            r.launch()
            self.note("start", r)
        for r in todo:
            r.wait_ready(timeout)

    # faults, noted
    def kill(self, r: Replica) -> Event:
        pid = r.pid or 0
        ev = self.note("kill", r, pid)  # noted before: the kill is at or after it
        r.kill()
        return ev

    def pause(self, r: Replica) -> Event:
        ev = self.note("pause", r)
        r.pause()
        return ev

    def resume(self, r: Replica) -> Event:
        r.resume()
        return self.note("resume", r)

    def cut(self, r: Replica) -> Event:
        ev = self.note("cut", r)
        r.cut()
        return ev

    def restore(self, r: Replica) -> Event:
        r.restore()
        return self.note("restore", r)

    def term(self, r: Replica) -> Event:
        ev = self.note("term", r)
        r.term()
        return ev

    # what the checks read
    def traces(self) -> list[Path]:
        return [p for r in self.replicas for p in r.traces if p.exists()]

    def deaths(self) -> dict[int, int]:
        return {pid: at for r in self.replicas for pid, at in r.deaths.items()}

    def wait_spools_drained(self, timeout: float = 60.0) -> bool:
        """Every running replica's ledger spool empty and its queue flushed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for r in self.replicas:
                if r.pid is None:
                    continue
                m = r.metrics()
                if (
                    m is None
                    or m.get("burstgate_ledger_spool_records", 0)
                    or m.get("burstgate_ledger_queue", 0)
                ):
                    ok = False
            if ok:
                return True
            time.sleep(0.25)
        return False

    def stop_all(self) -> None:
        """Graceful stop of every replica (writes what is queued)."""
        for r in self.replicas:
            if r.pid is not None:
                if r.proxy is not None:
                    r.restore()
                r.term()

    def close(self) -> None:
        """Kill whatever still runs, close the proxies, drop the database."""
        for r in self.replicas:
            with contextlib.suppress(Exception):
                if r.paused and r.pid is not None:
                    r.resume()
            r.hard_kill()
            if r.proxy is not None:
                r.proxy.close()
        if self.url:
            with contextlib.suppress(Exception):
                drop_database(self.url, self.admin_dsn)
            self.url = ""


def run_cli(url: str, *args: str) -> str:
    env = {**os.environ, "BURSTGATE_DATABASE_URL": url}
    out = subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"burstgate {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout


@contextlib.contextmanager
def cluster(out_dir: Path, n: int = 3, **kw: Any) -> Iterator[Cluster]:
    c = Cluster(out_dir, n, **kw)
    try:
        yield c
    finally:
        c.close()
