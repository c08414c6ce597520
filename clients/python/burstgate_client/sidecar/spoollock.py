"""One sidecar per completion spool file.

The SDK's spool file (sdk/spoolfile.py) assumes one writer: two sidecars
appending to, and compacting, the same file would lose each other's
Completes. With the spool on by default at a fixed name under the working
directory (or ``$STATE_DIRECTORY``), two sidecars started from one
directory would share it, so the sidecar takes an exclusive ``flock`` on
``<spool>.lock`` beside it for as long as it runs; a second one refuses to
start and names ``--spool``. The lock goes with the process (the kernel
drops it when the process dies, however it dies), so a crashed sidecar
leaves nothing to clean up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from burstgate_client.errors import InvalidArgument


class SpoolLock:
    """``acquire()`` raises InvalidArgument(--spool) when the directory
    cannot be made or written, or another process holds the lock."""

    def __init__(self, spool: Path) -> None:
        self.spool = spool
        self.path = spool.with_name(spool.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.spool.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise InvalidArgument(
                "--spool", f"cannot use {self.spool}: {exc.strerror}; choose a writable path "
                "with --spool, or --no-spool"
            ) from None  # fmt: skip
        if sys.platform != "win32":
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise InvalidArgument(
                    "--spool", f"{self.spool} is in use by another sidecar (it holds "
                    f"{self.path.name}); give each sidecar its own --spool"
                ) from None  # fmt: skip
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
