"""The replica lock's pieces without a server: which lock a database URL gets
(SQLite files only), and the SQLite sidecar-file lock (flock: exclusive even
between two opens in one process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.store.replica_lock import (
    Check,
    FileLock,
    ReplicaLock,
    ReplicaLockHeld,
    lock_for,
)

ROOT = Path(__file__).resolve().parents[2]


def test_which_lock_a_database_gets(tmp_path: Path) -> None:
    file_lock = lock_for(f"sqlite:///{tmp_path}/a.db", "me")
    assert isinstance(file_lock, FileLock)
    assert file_lock.path == tmp_path / "a.db.serve.lock"
    for private in ("sqlite://", "sqlite:///:memory:"):
        assert type(lock_for(private)) is ReplicaLock  # nothing to share, nothing to lock
    # PostgreSQL: replicas share the database (cells, controlplane.ha): no lock
    assert type(lock_for("postgres://u:pw@db.example:5432/bg")) is ReplicaLock


def test_a_second_file_lock_is_refused_until_the_first_is_released(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "burstgate.db"  # the directory need not exist yet
    first, second = FileLock(db, "serve one"), FileLock(db, "serve two")
    first.acquire()
    with pytest.raises(ReplicaLockHeld) as err:
        second.acquire()
    assert f"lock file {db}.serve.lock held by serve one" in str(err.value)
    assert "several replicas need PostgreSQL" in str(err.value)
    assert first.check().state is Check.HELD
    first.release()
    first.release()  # idempotent
    second.acquire()
    assert (Path(f"{db}.serve.lock").read_text()) == "serve two\n"
    second.release()


def test_a_removed_lock_file_is_locked_again_or_reported_lost(tmp_path: Path) -> None:
    db = tmp_path / "burstgate.db"
    ours = FileLock(db, "ours")
    ours.acquire()
    Path(f"{db}.serve.lock").unlink()  # an operator "cleaning up"
    assert ours.check().state is Check.REACQUIRED  # a new file, locked by us
    assert ours.check().state is Check.HELD
    Path(f"{db}.serve.lock").unlink()
    theirs = FileLock(db, "theirs")
    theirs.acquire()  # another serve took the new file first
    lost = ours.check()
    assert lost.state is Check.LOST and "held by theirs" in lost.holder
    theirs.release()
    assert ours.check().state is Check.REACQUIRED
    ours.release()
