"""The completion spool's file: durable adds, reload, compaction, torn lines."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk.spoolfile import COMPACT_MIN, SpoolFile


def req(i: int, **kw: Any) -> pb.CompleteRequest:
    return pb.CompleteRequest(
        tenant_id="acme", request_id=f"r{i}", prompt_tokens=i, generated_tokens=2 * i, **kw
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def add_all(f: SpoolFile, reqs: list[pb.CompleteRequest]) -> None:
    await asyncio.gather(*(f.add(r) for r in reqs))


def test_adds_are_on_disk_when_awaited_and_reload_in_order(tmp_path: Path) -> None:
    path = tmp_path / "spool" / "completes.jsonl"  # the directory is created
    f = SpoolFile(path)
    assert f.load() == []
    offline = pb.OfflineAdmission(lane="batch", model="m", pool="p")
    reqs = [req(i) for i in range(5)] + [req(9, offline=offline, exec_end_unix_ns=123)]
    asyncio.run(add_all(f, reqs))
    # durable before close: read the file while the spool is still open
    assert [d["add"]["request_id"] for d in lines(path)] == [r.request_id for r in reqs]
    f.close()
    again = SpoolFile(path).load()
    assert again == reqs  # every field, the offline admission included


def test_done_lines_remove_and_compaction_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    f = SpoolFile(path)
    f.load()
    asyncio.run(add_all(f, [req(i) for i in range(3)]))
    f.done(("acme", "r1"))
    f.close()
    g = SpoolFile(path)
    assert [r.request_id for r in g.load()] == ["r0", "r2"]
    # load compacts: the file now holds the two pending adds only
    assert [d["add"]["request_id"] for d in lines(path)] == ["r0", "r2"]
    g.done(("acme", "r0"))
    g.done(("acme", "r2"))
    g.close()
    assert path.read_text() == ""  # nothing pending: rewritten empty


def test_file_size_follows_what_is_pending(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    f = SpoolFile(path)
    f.load()
    n = COMPACT_MIN * 3

    async def churn() -> None:
        await f.add(req(0))  # stays pending throughout
        for start in range(1, n, 64):
            chunk = range(start, min(n, start + 64))
            await add_all(f, [req(i) for i in chunk])
            for i in chunk:
                f.done(("acme", f"r{i}"))

    asyncio.run(churn())
    f.close()
    # compactions kept it to at most COMPACT_MIN done lines plus what is pending
    assert len(lines(path)) <= 2 * COMPACT_MIN + 2
    assert [r.request_id for r in SpoolFile(path).load()] == ["r0"]


def test_torn_last_line_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.jsonl"
    f = SpoolFile(path)
    f.load()
    asyncio.run(add_all(f, [req(1), req(2)]))
    f.close()
    with path.open("a") as out:
        out.write('{"add":{"tenant_id":"acme","request_id":"r3","prompt_tok')  # a crash mid-write
    got = SpoolFile(path).load()
    assert [r.request_id for r in got] == ["r1", "r2"]
    assert "line 3 is not a spool entry" in caplog.text


def test_a_duplicate_add_keeps_the_first(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"add": {"tenant_id": "a", "request_id": "x", "prompt_tokens": "1"}}) + "\n"
        + json.dumps({"add": {"tenant_id": "a", "request_id": "x", "prompt_tokens": "2"}}) + "\n"
    )  # fmt: skip
    (only,) = SpoolFile(path).load()
    assert only.prompt_tokens == 1


def test_a_failed_write_fails_the_adds_and_leaves_no_torn_line(tmp_path: Path) -> None:
    """A write that fails (here the path turned into a directory, so the
    reopen fails: a read-only directory would not stop root) fails the
    awaiting adds with the OSError; what was durable before stays."""
    path = tmp_path / "c.jsonl"
    f = SpoolFile(path)
    f.load()
    asyncio.run(add_all(f, [req(1)]))
    f._close_file()  # the next write reopens the path...
    os.replace(path, tmp_path / "saved.jsonl")
    path.mkdir()  # ...which is now a directory: open() fails

    async def add_one() -> None:
        await f.add(req(2))

    with pytest.raises(OSError):
        asyncio.run(add_one())
    path.rmdir()
    os.replace(tmp_path / "saved.jsonl", path)
    f.close()
    assert [r.request_id for r in SpoolFile(path).load()] == ["r1"]


def test_adds_queued_during_a_write_share_one_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: the adds queued while the worker is busy go to disk
    with one fsync (the worker is held busy here, deterministically)."""
    import threading

    f = SpoolFile(tmp_path / "c.jsonl")
    f.load()
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    busy = threading.Event()
    f._executor.submit(busy.wait)  # the worker is busy (as with a slow fsync)

    async def burst() -> None:
        futures = [f.add(req(i)) for i in range(200)]
        busy.set()
        await asyncio.gather(*futures)

    asyncio.run(burst())
    f.close()
    assert len(fsyncs) == 1
    assert len(SpoolFile(tmp_path / "c.jsonl").load()) == 200
