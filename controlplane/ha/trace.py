"""The ownership trace: a test and diagnostic aid (docs/ha.md, "Acceptance").

Off unless ``BURSTGATE_HA_TRACE_FILE`` names a file. Then this process
appends one JSON line per ownership event, so a harness can check across
*processes* that no cell ever had two owners at once and that no pricing
window write landed under a superseded epoch:

- ``start``: a lease became valid here (``start_ns``: the acquire's answer)
  with its self-fencing deadline (``deadline_ns``). Written *before*
  ``owns()`` can answer with it, so a replica killed with ``kill -9`` leaves
  this line; its interval then ends at its last deadline.
- ``renew``: the lease's new deadline, written before it is used; the
  latest line is in force (a lone member's lease can be shortened: the
  coordinator's "lone" TTL).
- ``end``: the interval is over (``end_ns``: the release, the loss, or the
  deadline for a lease that ran out), with why.
- ``unused``: an acquire answered too late to be used (given straight back):
  its epoch superseded every earlier one from ``at_ns`` on.
- ``window_write``: a fenced pricing-window transaction that committed
  (``begin_ns`` before it was sent, ``done_ns`` after the commit returned);
  ``window_refused``: one the fence rolled back.

Times are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, shared by every process
on one host), or the coordinator's injected clock in seconds x 1e9. Each
line is one ``write(2)`` on an ``O_APPEND`` descriptor: nothing is buffered
in the process, so a killed process loses no line it returned from. Costs
nothing when off (one ``None`` check per lease event, none per request).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


class OwnershipTrace:
    def __init__(self, path: str | Path, member: str) -> None:
        self.path = Path(path)
        self.member = member
        self.pid = os.getpid()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # window writes come from a worker thread

    def write(self, ev: str, **fields: Any) -> None:
        """One line; ``member`` defaults to the process's (a coordinator
        names its own: tests run several in one process)."""
        line = json.dumps(
            {"ev": ev, "member": self.member, "pid": self.pid, **fields}, separators=(",", ":")
        )
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, line.encode() + b"\n")

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


# The process's trace (None: off). One per process, as the log is.
SINK: OwnershipTrace | None = None


def configure(path: str | Path | None, member: str) -> OwnershipTrace | None:
    """Open the trace at ``path`` for ``member`` (None: leave it off)."""
    global SINK
    if SINK is not None:
        SINK.close()
        SINK = None
    if path:
        SINK = OwnershipTrace(path, member)
    return SINK


def ns(seconds: float) -> int:
    """A coordinator clock reading (seconds) as the trace's nanoseconds."""
    return round(seconds * 1e9)
