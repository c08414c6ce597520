"""Opening a request log: a file, ``-`` (stdin), or any readable non-regular
file (``/dev/stdin``, a FIFO, a shell's ``<(...)``).

Nothing here seeks: the first ``SNIFF_BYTES`` are read ahead to recognise
gzip and Parquet by their magic bytes and CSV vs JSON Lines by the first
non-blank character, then replayed in front of the rest of the stream, so a
pipe works like a file. A byte counter on the raw stream drives progress.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

FileFormat = Literal["csv", "jsonl", "parquet"]
SNIFF_BYTES = 64 * 1024
GZIP_MAGIC = b"\x1f\x8b"
PARQUET_MAGIC = b"PAR1"
STDIN_NAMES = ("-",)


class SourceError(Exception):
    """The input cannot be opened (exit code 2)."""


class CountingReader(io.RawIOBase):
    """A raw stream that replays ``prefix`` and counts the bytes it hands out."""

    def __init__(self, prefix: bytes, rest: IO[bytes]) -> None:
        self._prefix = memoryview(prefix)
        self._rest = rest
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        if self._prefix:
            n = min(len(view), len(self._prefix))
            view[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
        else:
            n = self._rest.readinto(view)  # type: ignore[attr-defined]
            n = n or 0
        self.bytes_read += n
        return n


@dataclass(slots=True)
class Opened:
    """An open log: its text format, a decompressed byte stream and its size."""

    name: str
    fmt: FileFormat
    stream: IO[bytes]  # decompressed bytes, starting at the first byte
    counter: CountingReader  # raw (compressed) bytes consumed, for progress
    total: int | None  # raw size when known (regular files)


def _read_ahead(stream: IO[bytes], size: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _extension_format(name: str) -> FileFormat | None:
    suffixes = [s.lower() for s in Path(name).suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    ext = suffixes[-1] if suffixes else ""
    if ext == ".csv":
        return "csv"
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if ext == ".parquet":
        return "parquet"
    return None


def _sniff_text(head: bytes) -> FileFormat:
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return "jsonl" if text[:1] in (b"{", b"[") else "csv"


def is_stdin(path: str | os.PathLike[str]) -> bool:
    return str(path) in STDIN_NAMES


def _open_raw(path: str | os.PathLike[str]) -> tuple[IO[bytes], int | None, bool]:
    """(binary stream, size if a regular file, whether we own/close it)."""
    if is_stdin(path):
        return sys.stdin.buffer, None, False
    file_path = Path(path)
    try:
        info = file_path.stat()
    except FileNotFoundError:
        raise SourceError(f"{file_path}: no such file") from None
    except OSError as exc:
        raise SourceError(f"{file_path}: cannot open: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise SourceError(f"{file_path}: is a directory, not a request log")
    try:
        handle = open(file_path, "rb")  # noqa: SIM115 - closed by open_log's context
    except OSError as exc:
        raise SourceError(f"{file_path}: cannot open: {exc.strerror or exc}") from None
    return handle, (info.st_size if stat.S_ISREG(info.st_mode) else None), True


@contextmanager
def open_log(path: str | os.PathLike[str]) -> Iterator[Opened]:
    """Open ``path`` (``-`` = stdin), sniff its format, yield a decompressed stream."""
    name = "<stdin>" if is_stdin(path) else str(path)
    raw, total, owned = _open_raw(path)
    try:
        head = _read_ahead(raw, SNIFF_BYTES)
        counter = CountingReader(head, raw)
        buffered: IO[bytes] = io.BufferedReader(counter)
        if head.startswith(GZIP_MAGIC):
            inner: IO[bytes] = gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[assignment]
            inner_head = _read_ahead(inner, SNIFF_BYTES)
            stream: IO[bytes] = io.BufferedReader(CountingReader(inner_head, inner))
            head = inner_head
        else:
            stream = buffered
        fmt: FileFormat
        if head.startswith(PARQUET_MAGIC):
            fmt = "parquet"
        else:
            by_name = None if is_stdin(path) else _extension_format(name)
            fmt = by_name if by_name in ("csv", "jsonl") else _sniff_text(head)
        yield Opened(name=name, fmt=fmt, stream=stream, counter=counter, total=total)
    finally:
        if owned:
            raw.close()
