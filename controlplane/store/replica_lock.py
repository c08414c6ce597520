"""One ``burstgate serve`` per SQLite database: the replica lock.

Two servers on one SQLite file would each keep their own token buckets (a
tenant gets its rate once per server) and overwrite each other's
pricing-window rows. SQLite cannot coordinate replicas (docs/ha.md: scale-out
needs PostgreSQL), so a server takes this lock before it serves and keeps it
for its life; a second one refuses to start (``ReplicaLockHeld``, with a
message saying what to do). The CLI's database commands (``tenant``, ``keys``,
``export``, ...) never take it: they run beside the server by design.

- **SQLite**: an exclusive, non-blocking ``flock`` on ``<database file>.serve.lock``,
  held through an open descriptor (released by the kernel when the process
  ends, however it ends). An in-memory database is private to its process:
  nothing to lock.
- **PostgreSQL**: no lock. Several replicas share the database, each cell of
  pools owned by one of them through a lease (``controlplane.ha``).

The lock is checked on every config poll (``ReplicaGuard.poll``): a lock
file removed or replaced is locked again, and if another server took it
meanwhile, this one logs an error, reports NOT_SERVING on the gRPC health
service (overall and for the admission service) and keeps trying.

Every call of the guard runs on a daemon thread and is awaited for a bounded
time, so a stuck file system never stalls the poll loop, nor the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import structlog
from sqlalchemy.engine import make_url

from controlplane.aiotime import bounded, in_daemon_thread, within
from controlplane.settings import sqlalchemy_url

T = TypeVar("T")
log = structlog.get_logger("burstgate.replica_lock")

LOCK_FILE_SUFFIX = ".serve.lock"

# Seconds the event loop waits for one database call of the guard (the call
# itself may go on, on its daemon thread: a hung database keeps its locks).
ACQUIRE_WAIT_S = 30.0
THREAD = "replica-lock"  # the name of the lock calls' daemon threads
CHECK_WAIT_S = 2.0
RELEASE_WAIT_S = 5.0

HELP_TEXT = (
    "Two replicas on one SQLite database would each give every tenant its full rate and "
    "overwrite each other's pricing windows; several replicas need PostgreSQL. Stop the "
    "other one first, or move to PostgreSQL; see docs/operating.md, "
    '"Several replicas (high availability)".'
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
    """The replica lock of a database URL: a file lock for a SQLite file; a
    no-op lock for in-memory SQLite (private to its process) and for
    PostgreSQL (replicas share it: controlplane.ha owns cells instead)."""
    name = name or instance_name()
    url = make_url(sqlalchemy_url(database_url))
    if url.get_backend_name() == "sqlite":
        db = url.database
        if not db or db == ":memory:" or db.startswith("file:"):
            return ReplicaLock()  # private to this process (or a URI we do not parse)
        return FileLock(Path(db).absolute(), name)
    return ReplicaLock()


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
        await bounded(in_daemon_thread(self.lock.acquire, THREAD), ACQUIRE_WAIT_S, "replica lock")
        self.held = True

    async def poll(self) -> None:
        """One poll step: check the lock, take it again if it was lost.
        Raises when the database cannot be asked (the caller logs it; the
        next poll tries again); a check still waiting on a hung database is
        left to finish (the session, and its lock, outlive a hang)."""
        if self._pending is not None and not self._pending.done():
            return
        self._pending = in_daemon_thread(self.lock.check, THREAD)
        result: CheckResult = await bounded(self._pending, CHECK_WAIT_S, "replica lock check")
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
            await bounded(in_daemon_thread(self.lock.release, THREAD), RELEASE_WAIT_S, "release")
        self.held = False
