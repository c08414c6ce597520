"""One ``burstgate serve`` per database: the replica lock.

Two servers on one database would each keep their own token buckets (a tenant
gets its rate once per server) and overwrite each other's pricing-window rows.
Until scale-out exists, a server takes this lock before it serves and keeps it
for its life; a second one refuses to start (``ReplicaLockHeld``, with a
message saying what to do). The CLI's database commands (``tenant``, ``keys``,
``export``, ...) never take it: they run beside the server by design.

- **PostgreSQL**: a session-level advisory lock, ``pg_try_advisory_lock(LOCK_KEY)``,
  on a connection of its own (never one of the SQLAlchemy pool, which
  pre-pings and recycles its connections: the lock lives exactly as long as
  its session). Advisory locks are per database, so servers on other
  databases of the same PostgreSQL never meet.
- **SQLite**: an exclusive, non-blocking ``flock`` on ``<database file>.serve.lock``,
  held through an open descriptor (released by the kernel when the process
  ends, however it ends). An in-memory database is private to its process:
  nothing to lock.

The lock is checked on every config poll (``ReplicaGuard.poll``). A
PostgreSQL session can die (server restart, network cut, an operator's
``pg_terminate_backend``), and its lock with it: the guard then takes the lock
again on a fresh connection. If another replica took it meanwhile, this one
logs an error, reports NOT_SERVING on the gRPC health service (overall and
for the admission service) and ``burstgate_replica_lock_held 0``, keeps
answering (an outage would not make the other replica's buckets right), and
keeps trying: when the other one stops, it takes the lock back and reports
SERVING again. After a network cut the server may still hold our old session
(it notices dead peers only by its TCP keepalive): a lock held by our own
earlier session, recognised by its backend pid and start time, is ended with
``pg_terminate_backend`` and taken again.

Every database call of the guard runs on a daemon thread and is awaited for a
bounded time: a database that hangs (it keeps its sessions, and their locks)
never stalls the poll loop, nor, at exit, the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import hashlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import URL, make_url

from controlplane.aiotime import within
from controlplane.settings import sqlalchemy_url

T = TypeVar("T")
log = structlog.get_logger("burstgate.replica_lock")

LOCK_NAME = "burstgate.serve"
# The advisory lock's 64-bit key: the first 8 bytes of SHA-256("burstgate.serve"),
# as a signed big-endian integer (docs/operating.md states the number; a test
# checks it). pg_locks shows it as classid (high 32 bits) and objid (low 32 bits).
LOCK_KEY = int.from_bytes(hashlib.sha256(LOCK_NAME.encode()).digest()[:8], "big", signed=True)
LOCK_FILE_SUFFIX = ".serve.lock"

# libpq options of the lock's own connection, unless the database URL sets them:
# a bounded connect, and a session that notices a dead peer within seconds
# (unacknowledged data for 10 s, or 3 keepalives 5 s apart after 10 s idle).
PG_CONNECT_DEFAULTS: dict[str, str] = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}
# Seconds the event loop waits for one database call of the guard (the call
# itself may go on, on its daemon thread: a hung database keeps its locks).
ACQUIRE_WAIT_S = 30.0
CHECK_WAIT_S = 2.0
RELEASE_WAIT_S = 5.0
# How long pg_terminate_backend waits for our own stale session to end (ms).
TERMINATE_WAIT_MS = 5000

HELP_TEXT = (
    "Two replicas on one database would each give every tenant its full rate and "
    "overwrite each other's pricing windows; scale-out is not supported yet. Stop the "
    "other one first, or give this one a database of its own; see docs/operating.md, "
    '"One replica per database".'
)


class ReplicaLockHeld(RuntimeError):
    """Another ``burstgate serve`` holds this database; ``str()`` is the
    operator's message (the database with its password hidden, the holder
    when known, and what to do)."""

    def __init__(self, database: str, holder: str) -> None:
        self.database = database
        self.holder = holder
        super().__init__(
            f"another `burstgate serve` is running on database {database} ({holder}). {HELP_TEXT}"
        )


class Check(enum.Enum):
    HELD = "held"  # still ours
    REACQUIRED = "reacquired"  # it was lost and is ours again
    LOST = "lost"  # another replica holds it now


@dataclass(frozen=True)
class CheckResult:
    state: Check
    holder: str = ""  # with LOST: who holds it


def instance_name() -> str:
    """What the holder is called in messages and pg_stat_activity."""
    return f"burstgate serve {socket.gethostname()} pid {os.getpid()}"


class ReplicaLock:
    """Take, check and release the lock of one database; blocking calls, made
    one at a time (``ReplicaGuard`` runs them on a thread)."""

    database = ""  # for messages, password hidden

    def acquire(self) -> None:
        """Take it, or raise ReplicaLockHeld."""

    def check(self) -> CheckResult:
        """Whether it is still ours; if it was lost, try to take it again.
        Raises when the database cannot be asked (retried at the next poll)."""
        return CheckResult(Check.HELD)

    def release(self) -> None:
        """Give it up (idempotent)."""


class PostgresLock(ReplicaLock):
    def __init__(self, url: URL, name: str) -> None:
        import psycopg.conninfo

        plain = url.set(drivername="postgresql")  # as users write it, and as libpq reads it
        self.database = plain.render_as_string(hide_password=True)
        libpq_url = plain.render_as_string(hide_password=False)
        params: dict[str, Any] = psycopg.conninfo.conninfo_to_dict(libpq_url)
        for key, value in PG_CONNECT_DEFAULTS.items():
            params.setdefault(key, value)
        params.setdefault("application_name", name[:63])  # NAMEDATALEN - 1
        self._params = params
        self._conn: Any = None  # psycopg.Connection holding the lock
        self._session: tuple[int, Any] | None = None  # (backend pid, backend_start)

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(**self._params, autocommit=True)

    @staticmethod
    def _try_lock(conn: Any) -> tuple[bool, tuple[int, Any]]:
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s), pg_backend_pid(),"
            " (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())",
            [LOCK_KEY],
        ).fetchone()
        return bool(row[0]), (int(row[1]), row[2])

    @staticmethod
    def _holder(conn: Any) -> tuple[tuple[int, Any] | None, str]:
        """The session holding the lock, and a description of it (best effort:
        another role's client address may be hidden from us)."""
        try:
            row = conn.execute(
                "SELECT l.pid, a.backend_start, a.application_name, host(a.client_addr)"
                " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
                " AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid"
                " AND l.database = (SELECT oid FROM pg_database"
                "                   WHERE datname = current_database())",
                [(LOCK_KEY >> 32) & 0xFFFFFFFF, LOCK_KEY & 0xFFFFFFFF],
            ).fetchone()
        except Exception:  # a view we may not read: the message says less
            return None, "held by another session"
        if row is None:  # released in the meantime
            return None, "held by another session, just released: try again"
        pid, started, app, addr = row
        parts = [f"held by session pid {pid}"]
        if app:
            parts.append(f"application {app!r}")
        if addr:
            parts.append(f"from {addr}")
        if started is not None:
            parts.append(f"since {started:%Y-%m-%d %H:%M:%S %Z}".rstrip())
        return (int(pid), started), ", ".join(parts)

    def acquire(self) -> None:
        conn = self._connect()
        try:
            got, session = self._try_lock(conn)
            if not got:
                raise ReplicaLockHeld(self.database, self._holder(conn)[1])
        except BaseException:
            conn.close()
            raise
        self._conn, self._session = conn, session

    def check(self) -> CheckResult:
        import psycopg

        if self._conn is not None:
            try:
                self._conn.execute("SELECT 1")
                return CheckResult(Check.HELD)
            except psycopg.Error as exc:  # the session is gone, and its lock with it
                log.warning("replica lock session lost; taking the lock again", error=str(exc))
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None
        conn = self._connect()  # raises while the database is unreachable
        try:
            got, session = self._try_lock(conn)
            holder: tuple[int, Any] | None = None
            about = ""
            if not got:
                holder, about = self._holder(conn)
                if holder is not None and holder == self._session:
                    # Our own earlier session, which the server has not yet
                    # found dead (a network cut): end it and take the lock.
                    log.warning("replica lock held by our own stale session; ending it",
                                pid=holder[0])  # fmt: skip
                    conn.execute(
                        "SELECT pg_terminate_backend(%s, %s)", [holder[0], TERMINATE_WAIT_MS]
                    )
                    got, session = self._try_lock(conn)
            if not got:
                conn.close()
                return CheckResult(Check.LOST, about or "held by another session")
        except BaseException:
            conn.close()
            raise
        self._conn, self._session = conn, session
        return CheckResult(Check.REACQUIRED)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # the session ends: the server releases its lock


class FileLock(ReplicaLock):
    """SQLite: flock on a sidecar file next to the database file. The file is
    never deleted (deleting a lock file races with the next one taking it);
    it holds the holder's name, for the refusal message."""

    def __init__(self, db_file: Path, name: str) -> None:
        self.path = Path(f"{db_file}{LOCK_FILE_SUFFIX}")
        self.database = f"sqlite:///{db_file}"
        self._name = name
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+", encoding="utf-8")  # "a+": never truncated before it is ours
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            who = f.read(200).strip()
            f.close()
            raise ReplicaLockHeld(
                self.database, f"lock file {self.path} held by {who or 'another process'}"
            ) from None
        except BaseException:
            f.close()
            raise
        f.seek(0)
        f.truncate()
        f.write(self._name + "\n")
        f.flush()
        self._file = f

    def check(self) -> CheckResult:
        f = self._file
        if f is not None:
            try:
                on_disk = os.stat(self.path)
            except FileNotFoundError:
                on_disk = None
            mine = os.fstat(f.fileno())
            if on_disk is not None and (on_disk.st_dev, on_disk.st_ino) == (
                mine.st_dev,
                mine.st_ino,
            ):
                return CheckResult(Check.HELD)
            # Removed or replaced: a new server would lock the new file, so
            # ours guards nothing any more.
            log.warning("replica lock file removed or replaced; locking it again",
                        path=str(self.path))  # fmt: skip
            self.release()
        try:
            self.acquire()
        except ReplicaLockHeld as exc:
            return CheckResult(Check.LOST, exc.holder)
        return CheckResult(Check.REACQUIRED)

    def release(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


def lock_for(database_url: str, name: str | None = None) -> ReplicaLock:
    """The replica lock of a database URL (a no-op lock for in-memory SQLite)."""
    name = name or instance_name()
    url = make_url(sqlalchemy_url(database_url))
    if url.get_backend_name() == "sqlite":
        db = url.database
        if not db or db == ":memory:" or db.startswith("file:"):
            return ReplicaLock()  # private to this process (or a URI we do not parse)
        return FileLock(Path(db).absolute(), name)
    return PostgresLock(url, name)


def _in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[tuple[bool, Any]]:
    """``fn()`` on a daemon thread; the future gets (True, result) or (False,
    exception), never an exception of its own (nobody may be waiting). A
    daemon thread, not the loop's executor: one blocked on a hung database
    must not keep the process from exiting."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[bool, Any]] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not fut.done():
            fut.set_result(outcome)

    def run() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, fn())
        except BaseException as exc:
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name="replica-lock", daemon=True).start()
    return fut


async def _bounded(fut: asyncio.Future[tuple[bool, Any]], wait_s: float, what: str) -> Any:
    try:
        ok, value = await within(asyncio.shield(fut), wait_s)
    except TimeoutError:
        raise TimeoutError(f"{what}: no answer from the database within {wait_s:g} s") from None
    if not ok:
        raise value
    return value


class ReplicaGuard:
    """The server's side of the lock: take it at start, check it on every
    config poll, give it up at stop; report through ``on_change(held)`` (the
    server's health) and a metrics collector."""

    def __init__(self, lock: ReplicaLock, on_change: Callable[[bool], None]) -> None:
        self.lock = lock
        self.held = False
        self.lost_total = 0  # times another replica was found holding it
        self._on_change = on_change
        self._pending: asyncio.Future[tuple[bool, Any]] | None = None

    async def acquire(self) -> None:
        """Take the lock before serving; ReplicaLockHeld if another replica
        has it (not logged here: the caller reports it, `serve` in one line)."""
        await _bounded(_in_daemon_thread(self.lock.acquire), ACQUIRE_WAIT_S, "replica lock")
        self.held = True

    async def poll(self) -> None:
        """One poll step: check the lock, take it again if it was lost.
        Raises when the database cannot be asked (the caller logs it; the
        next poll tries again); a check still waiting on a hung database is
        left to finish (the session, and its lock, outlive a hang)."""
        if self._pending is not None and not self._pending.done():
            return
        self._pending = _in_daemon_thread(self.lock.check)
        result: CheckResult = await _bounded(self._pending, CHECK_WAIT_S, "replica lock check")
        self._pending = None
        if result.state is Check.LOST:
            if self.held:  # reported once; the next polls keep trying quietly
                self.lost_total += 1
                log.error(
                    "replica lock lost: another burstgate serve runs on this database; "
                    "health NOT_SERVING until it stops",
                    database=self.lock.database, holder=result.holder,
                )  # fmt: skip
                self.held = False
                self._on_change(False)
        elif result.state is Check.REACQUIRED:
            log.warning("replica lock taken again", database=self.lock.database)
            if not self.held:
                self.held = True
                self._on_change(True)

    async def release(self) -> None:
        """Give the lock up (at stop). A check blocked on a hung database is
        waited for a while; if it is still blocked, its connection is left to
        the process's exit rather than closed under it."""
        pending = self._pending
        if pending is not None and not pending.done():
            with contextlib.suppress(TimeoutError):
                await within(asyncio.shield(pending), RELEASE_WAIT_S)
            if not pending.done():
                log.warning("replica lock left to the process's exit (database not answering)")
                self.held = False
                return
        with contextlib.suppress(Exception):
            await _bounded(_in_daemon_thread(self.lock.release), RELEASE_WAIT_S, "release")
        self.held = False

    def collector(self) -> Collector:
        return _GuardCollector(self)


class _GuardCollector(Collector):
    def __init__(self, guard: ReplicaGuard) -> None:
        self._guard = guard

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "burstgate_replica_lock_held",
            "1 while this server holds its database's replica lock (one serve per database)",
            value=int(self._guard.held),
        )
        yield CounterMetricFamily(
            "burstgate_replica_lock_lost",
            "Times another burstgate serve was found holding this server's database",
            value=self._guard.lost_total,
        )
