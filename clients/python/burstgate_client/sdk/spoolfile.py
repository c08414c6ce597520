"""The completion spool on disk: an append-only JSON-lines file.

One line per event, ``{"add": <CompleteRequest as proto JSON>}`` when a
Complete is buffered and ``{"done": [tenant_id, request_id]}`` when it was
delivered (or given up on). Reloaded at start, so a restarted sidecar still
delivers what it buffered: the adds without a later done are pending; a torn
last line (a crash mid-write) is skipped with a warning.

Durability: *group commit*. ``add`` returns an awaitable that resolves once
its line is written and fsync'ed; every line queued while one fsync runs
goes to disk with the next, so a burst of buffered Completes costs one fsync
per group, not per line, and the caller is told "buffered" only once the
line is durable. Done lines ride along with the next group (a lost done line
only means a redelivery, which the server answers as a duplicate). All file
I/O runs on one worker thread, off the event loop, in order.

Compaction: when the done lines outnumber the pending ones (and at least
``COMPACT_MIN``), and at load, the worker rewrites the file with just the
pending adds (a temporary file, fsync, rename, fsync of the directory), so
the file's size follows what is pending, not what was ever buffered; when
nothing is pending it is rewritten empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from google.protobuf import json_format

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

log = logging.getLogger("burstgate.sdk")

COMPACT_MIN = 1024
Key = tuple[str, str]


def key_of(req: pb.CompleteRequest) -> Key:
    return (req.tenant_id, req.request_id)


class SpoolFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="burstgate-spool")
        self._mu = threading.Lock()
        self._lines: list[str] = []
        self._futures: list[asyncio.Future[None]] = []
        self._scheduled = False
        # Owned by the worker thread: what the file holds as pending.
        self._live: dict[Key, str] = {}
        self._dead = 0
        self._file: IO[str] | None = None

    # ------------------------------------------------------- the event loop's

    def load(self) -> list[pb.CompleteRequest]:
        """Read the file (creating it when absent) and compact it; return
        the pending Completes, oldest first. Call before anything is added."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    self._apply_loaded(line, n)
        self._compact()
        out = []
        for line in self._live.values():
            req = pb.CompleteRequest()
            json_format.ParseDict(json.loads(line)["add"], req)
            out.append(req)
        return out

    def add(self, req: pb.CompleteRequest) -> asyncio.Future[None]:
        """Queue ``req``'s add line; the future resolves once it is durable
        (or fails with the OSError that kept it from disk)."""
        doc = json_format.MessageToDict(req, preserving_proto_field_name=True)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue(json.dumps({"add": doc}, separators=(",", ":")), fut)
        return fut

    def done(self, key: Key) -> None:
        self._queue(json.dumps({"done": list(key)}, separators=(",", ":")), None)

    def close(self) -> None:
        """Write what is queued and close the file (blocks until written)."""
        self._executor.submit(self._flush_job).result()
        self._executor.submit(self._close_file).result()
        self._executor.shutdown(wait=True)

    def _queue(self, line: str, fut: asyncio.Future[None] | None) -> None:
        with self._mu:
            self._lines.append(line)
            if fut is not None:
                self._futures.append(fut)
            schedule, self._scheduled = not self._scheduled, True
        if schedule:
            self._executor.submit(self._flush_job)

    # --------------------------------------------------------- worker thread

    def _apply_loaded(self, line: str, n: int) -> None:
        try:
            doc = json.loads(line)
            if "add" in doc:
                key = (doc["add"]["tenant_id"], doc["add"]["request_id"])
                self._live.setdefault(key, line.rstrip("\n"))
            else:
                tenant_id, request_id = doc["done"]
                self._live.pop((tenant_id, request_id), None)
        except (ValueError, KeyError, TypeError):
            log.warning("completion spool %s: line %d is not a spool entry, skipped", self.path, n)

    def _apply(self, line: str) -> None:
        doc = json.loads(line)
        if "add" in doc:
            self._live.setdefault((doc["add"]["tenant_id"], doc["add"]["request_id"]), line)
        else:
            if self._live.pop(tuple(doc["done"]), None) is not None:
                self._dead += 1

    def _flush_job(self) -> None:
        with self._mu:
            lines, futures = self._lines, self._futures
            self._lines, self._futures, self._scheduled = [], [], False
        err: OSError | None = None
        if lines:
            f = None
            at = 0
            try:
                f = self._open()
                at = f.tell()
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
                for line in lines:
                    self._apply(line)
                if self._dead >= max(COMPACT_MIN, len(self._live)) or (
                    not self._live and self._dead
                ):
                    self._compact()
            except OSError as exc:
                log.error("completion spool %s: write failed: %s", self.path, exc)
                err = exc
                self._cut(f, at)
        for fut in futures:
            fut.get_loop().call_soon_threadsafe(_settle, fut, err)

    def _cut(self, f: IO[str] | None, at: int) -> None:
        """After a failed write: cut the file back to where the group began,
        so a torn line cannot swallow the next group's first line."""
        self._close_file()
        if f is None:
            return
        try:
            os.truncate(self.path, at)
        except OSError as exc:
            log.error("completion spool %s: cannot cut a torn write: %s", self.path, exc)

    def _open(self) -> IO[str]:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        return self._file

    def _compact(self) -> None:
        self._close_file()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in self._live.values()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._dead = 0

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _settle(fut: asyncio.Future[None], err: OSError | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
