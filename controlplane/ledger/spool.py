"""The local append-only spool: where acknowledged ledger records wait while
the database is unreachable or slow.

A directory of segment files ``<seq>.spool``. Appends go to the newest
segment; each append is one frame, written and ``fsync``ed before it
returns (and the directory is fsynced when a segment is created), so a
record is durable on the local disk when ``append`` returns. The drainer
seals the current segment (later appends start a new one), replays sealed
segments into the database, and deletes each one after its rows are
committed.

Frame: ``b"BGL1"``, payload length (4 bytes, big-endian), CRC-32 of the
payload (4 bytes), payload = UTF-8 JSON list of rows. A torn frame at the
tail of a segment (a crash during a write, never acknowledged) ends that
segment's replay; a bad frame elsewhere stops the replay of that segment and
renames it ``*.corrupt`` for an operator (it is logged).

The spool's total size is bounded: an append that would pass the bound
raises ``SpoolFull`` and writes nothing.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import structlog

from controlplane.domain.ledger_records import LedgerRecord, from_json_row, to_json_row

log = structlog.get_logger("burstgate.ledger.spool")

MAGIC = b"BGL1"
HEADER = struct.Struct(">4sII")
SUFFIX = ".spool"


class SpoolFull(Exception):
    """The spool is at its configured bound."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(records: list[LedgerRecord]) -> bytes:
    payload = json.dumps(
        [to_json_row(r) for r in records], separators=(",", ":"), ensure_ascii=False
    ).encode()
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


class Spool:
    """Thread-safe; every method may block on the disk (call it off the loop)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._current: Path | None = None
        self._fd: int | None = None
        self._seq = 0
        self.bytes = 0
        self.records = 0
        if directory.exists():
            for seg in self.segments():
                self.bytes += seg.stat().st_size
                self._seq = max(self._seq, int(seg.stem))

    # ------------------------------------------------------------- writing

    def segments(self) -> list[Path]:
        if not self.directory.exists():
            return []
        return sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: int(p.stem))

    def append(self, records: list[LedgerRecord]) -> int:
        """Write one frame and fsync it; returns its size. Raises SpoolFull."""
        frame = encode(records)
        with self._lock:
            if self.bytes + len(frame) > self.max_bytes:
                raise SpoolFull(
                    f"ledger spool at {self.bytes:,} of {self.max_bytes:,} bytes ({self.directory})"
                )
            if self._fd is None:
                self._open_segment()
            assert self._fd is not None
            view = memoryview(frame)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
            self.bytes += len(frame)
            self.records += len(records)
            return len(frame)

    def _open_segment(self) -> None:
        created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        if created:
            _fsync_dir(self.directory.parent)
        self._seq += 1
        self._current = self.directory / f"{self._seq:020d}{SUFFIX}"
        self._fd = os.open(self._current, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _fsync_dir(self.directory)

    def seal(self) -> list[Path]:
        """Close the current segment; return every sealed segment, oldest first."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self._current = None
            return self.segments()

    def remove(self, segment: Path, records: int) -> None:
        with self._lock:
            size = segment.stat().st_size
            segment.unlink()
            _fsync_dir(self.directory)
            self.bytes -= size
            self.records = max(0, self.records - records)

    def quarantine(self, segment: Path, target: Path, records: int) -> None:
        """Set a corrupt segment aside (renamed) once its good frames are in."""
        with self._lock:
            size = segment.stat().st_size
            segment.rename(target)
            _fsync_dir(self.directory)
            self.bytes -= size
            self.records = max(0, self.records - records)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self.directory.exists() and not any(self.directory.iterdir()):
                self.directory.rmdir()  # leave nothing behind when nothing waits

    # ------------------------------------------------------------- reading

    def read(self, segment: Path) -> Iterator[list[LedgerRecord]]:
        """The frames of a sealed segment, in order."""
        data = segment.read_bytes()
        pos = 0
        while pos < len(data):
            if len(data) - pos < HEADER.size:
                log.warning("torn frame at the end of a spool segment", segment=str(segment))
                return
            magic, length, crc = HEADER.unpack_from(data, pos)
            payload = data[pos + HEADER.size : pos + HEADER.size + length]
            if magic != MAGIC or len(payload) < length:
                if magic == MAGIC and pos + HEADER.size + length > len(data):
                    log.warning("torn frame at the end of a spool segment", segment=str(segment))
                    return
                self._quarantine(segment, pos)
                return
            if zlib.crc32(payload) != crc:
                if pos + HEADER.size + length == len(data):
                    log.warning("torn frame at the end of a spool segment", segment=str(segment))
                    return
                self._quarantine(segment, pos)
                return
            yield [from_json_row(row) for row in json.loads(payload)]
            pos += HEADER.size + length

    def _quarantine(self, segment: Path, offset: int) -> None:
        target = segment.with_suffix(".corrupt")
        log.error(
            "corrupt spool segment; kept for an operator",
            segment=str(segment),
            offset=offset,
            renamed_to=str(target),
        )
        raise CorruptSegment(segment, target)

    def read_all(self) -> list[LedgerRecord]:
        out: list[LedgerRecord] = []
        for seg in self.segments():
            try:
                for frame in self.read(seg):
                    out.extend(frame)
            except CorruptSegment:
                continue
        return out


class CorruptSegment(Exception):
    def __init__(self, segment: Path, target: Path) -> None:
        super().__init__(f"corrupt spool segment {segment}")
        self.segment = segment
        self.target = target
