"""Where the completion spool is (on by default), the lock that keeps it to
one sidecar, and the access log's writer and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from burstgate_client.errors import InvalidArgument
from burstgate_client.sidecar.accesslog import FIELDS, AccessLog
from burstgate_client.sidecar.config import DEFAULT_SPOOL, load, spool_line
from burstgate_client.sidecar.spoollock import SpoolLock

FLAGS: dict[str, Any] = {"upstream": "http://127.0.0.1:8000", "control_plane": "127.0.0.1:50051"}


def test_the_spool_is_on_by_default_under_state_directory_or_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load(**FLAGS)
    assert cfg.spool and cfg.spool_path is None
    # systemd's StateDirectory= (several directories: the first)
    state = {"STATE_DIRECTORY": f"{tmp_path}/a:{tmp_path}/b"}
    assert cfg.spool_file(state) == tmp_path / "a" / DEFAULT_SPOOL
    monkeypatch.chdir(tmp_path)
    assert cfg.spool_file({}) == tmp_path / DEFAULT_SPOOL
    assert cfg.spool_file({"STATE_DIRECTORY": ""}) == tmp_path / DEFAULT_SPOOL
    chosen = load(**FLAGS, spool_path=tmp_path / "x.jsonl")
    assert chosen.spool_file(state) == tmp_path / "x.jsonl"
    off = load(**FLAGS, spool=False)
    assert off.spool_file(state) is None
    assert "lost" in spool_line(None) and str(tmp_path) in spool_line(tmp_path / DEFAULT_SPOOL)


def test_spool_flags_override_the_file_and_contradictions_are_named(tmp_path: Path) -> None:
    in_file = tmp_path / "sidecar.yaml"
    in_file.write_text("spool_path: /var/lib/x.jsonl\n")
    assert load(in_file, **FLAGS, spool=False).spool_file() is None  # --no-spool wins
    in_file.write_text("spool: false\n")
    assert load(in_file, **FLAGS, spool_path=tmp_path / "y").spool_file() == tmp_path / "y"
    with pytest.raises(InvalidArgument, match=r"^--no-spool: cannot be given with --spool"):
        load(**FLAGS, spool=False, spool_path=tmp_path / "y")
    in_file.write_text("spool: false\nspool_path: /var/lib/x.jsonl\n")
    with pytest.raises(InvalidArgument, match=r"sidecar.yaml: spool: false, but spool_path"):
        load(in_file, **FLAGS)
    in_file.write_text("access_log: ''\n")
    with pytest.raises(InvalidArgument, match=r"sidecar.yaml: access_log"):
        load(in_file, **FLAGS)


def test_one_sidecar_per_spool(tmp_path: Path) -> None:
    spool = tmp_path / "deep" / "spool.jsonl"
    first, second = SpoolLock(spool), SpoolLock(spool)
    first.acquire()  # makes the directory
    assert (tmp_path / "deep" / "spool.jsonl.lock").exists()
    with pytest.raises(InvalidArgument) as err:
        second.acquire()
    assert err.value.field == "--spool" and "in use by another sidecar" in str(err.value)
    first.release()
    second.acquire()  # free again once the first let go
    second.release()
    blocked = SpoolLock(tmp_path / "deep" / "spool.jsonl.lock" / "spool.jsonl")  # under a file
    with pytest.raises(InvalidArgument, match=r"^--spool: cannot use .*--no-spool"):
        blocked.acquire()


def test_the_access_log_writes_one_json_line_per_call_with_every_field(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    log = AccessLog(str(path))
    log.write(request_id="r1", tenant="acme", status=200, total_ms=1.5, ignored="x")
    log.write(request_id="r2", status=429, reason="token_rate")
    log.close()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert list(first) == list(FIELDS)  # every key, in order; unknown ones dropped
    assert (first["request_id"], first["tenant"], first["status"]) == ("r1", "acme", 200)
    assert first["lane"] is None and first["total_ms"] == 1.5
    assert (second["reason"], second["tenant"]) == ("token_rate", None)
    with pytest.raises(InvalidArgument, match=r"^--access-log: cannot open"):
        AccessLog(str(tmp_path / "no-such-dir" / "access.log"))


def test_the_access_log_to_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    log = AccessLog("-")
    log.write(request_id="r1", outcome="admitted")
    log.close()
    (line,) = capfd.readouterr().out.splitlines()
    assert json.loads(line)["outcome"] == "admitted"
