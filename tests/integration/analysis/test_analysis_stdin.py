"""Logs that are not regular files: ``-``, ``/dev/stdin``, ``<(...)``, through a
real process (stdin and /dev/fd are the process's own)."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controlplane.analysis.progress import Phases
from controlplane.analysis.reader import read_log
from controlplane.analysis.summary import analyze
from tests.integration.analysis.shapes import (
    ledger_rows,
    mooncake_offsets_ms,
    write_ledger_export,
    write_mooncake,
)

REPO = Path(__file__).resolve().parents[3]


def burstgate(*args: str, stdin: bytes = b"") -> tuple[int, dict[str, Any] | None, str]:
    done = subprocess.run(
        [sys.executable, "-m", "controlplane.analysis", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    out = done.stdout.decode()
    return done.returncode, json.loads(out) if out.startswith("{") else None, done.stderr.decode()


@pytest.fixture(scope="module")
def mooncake_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ts_ms = mooncake_offsets_ms(4.0, 600)
    path = tmp_path_factory.mktemp("stdin") / "trace.jsonl"
    return write_mooncake(path, ts_ms.tolist(), [200] * ts_ms.size, [20] * ts_ms.size)


@pytest.fixture(scope="module")
def expected(mooncake_file: Path) -> dict[str, Any]:
    code, doc, err = burstgate("analyze", str(mooncake_file), "--json")
    assert code == 0 and doc is not None, err
    return doc


def _same_figures(doc: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    assert doc is not None
    assert doc["span"] == expected["span"] and doc["rows"] == expected["rows"]
    assert doc["overall"] == expected["overall"]
    assert doc["input"]["preset"] == "mooncake" and doc["input"]["time"]["unit"] == "ms"


def test_dash_reads_stdin(mooncake_file: Path, expected: dict[str, Any]) -> None:
    code, doc, err = burstgate("analyze", "-", "--json", stdin=mooncake_file.read_bytes())
    assert code == 0, err
    _same_figures(doc, expected)
    assert doc is not None and doc["source"] == "<stdin>"


def test_dev_stdin_and_gzip_on_a_pipe(mooncake_file: Path, expected: dict[str, Any]) -> None:
    packed = gzip.compress(mooncake_file.read_bytes())
    code, doc, err = burstgate("analyze", "/dev/stdin", "--json", stdin=packed)
    assert code == 0, err
    _same_figures(doc, expected)


def test_process_substitution(mooncake_file: Path, expected: dict[str, Any]) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    script = 'exec "$0" -m controlplane.analysis analyze <(cat "$1") --json'
    done = subprocess.run(
        [bash, "-c", script, sys.executable, str(mooncake_file)],
        capture_output=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    doc = json.loads(done.stdout)
    _same_figures(doc, expected)
    assert doc["source"].startswith("/dev/fd/")


def test_parquet_and_csv_on_stdin_with_plan(tmp_path: Path) -> None:
    rows = ledger_rows(300)
    parquet = write_ledger_export(tmp_path / "l.parquet", "parquet", rows).read_bytes()
    csv = write_ledger_export(tmp_path / "l.csv", "csv", rows).read_bytes()
    plans, formats = [], []
    for data in (parquet, csv):
        code, doc, err = burstgate("plan", "-", "--rps", "1", "--json", stdin=data)
        assert code == 0 and doc is not None, err
        assert doc["input"]["preset"] == "ledger"
        plans.append(doc["plan"])
        formats.append(doc["input"]["file_format"])
    assert formats == ["parquet", "csv"] and plans[0] == plans[1] and plans[0] is not None


def test_missing_and_directory_inputs(tmp_path: Path) -> None:
    code, _, err = burstgate("analyze", str(tmp_path / "nope.jsonl"))
    assert code == 2 and err.strip() == f"error: {tmp_path / 'nope.jsonl'}: no such file"
    code, _, err = burstgate("analyze", str(tmp_path))
    assert code == 2 and "is a directory" in err


# --------------------------------------------------------------------------- progress


def test_phases_draw_reading_and_analysing(mooncake_file: Path) -> None:
    screen = io.StringIO()
    labels: list[tuple[str, int, int]] = []
    with Phases(True, file=screen) as phases:
        log = read_log(mooncake_file, progress=phases)
        with phases.steps("analysing") as step:

            def record(label: str, done: int, total: int) -> None:
                labels.append((label, done, total))
                step(label, done, total)

            analyze(log, progress=record)
        with phases.spinner("rendering HTML report"):
            pass
    drawn = screen.getvalue()
    assert "analysing: overall" in drawn and "rendering HTML report" in drawn
    # The file has block ids: the prefix cache is a step of its own.
    assert [label for label, _, _ in labels] == [
        "overall",
        "incidents",
        "prefix cache: unbounded",
        "done",
    ]
    assert [done for _, done, _ in labels] == [0, 1, 2, 3] and labels[-1][2] == 3


def test_analysis_progress_counts_tenants(tmp_path: Path) -> None:
    log = read_log(write_ledger_export(tmp_path / "l.csv", "csv", ledger_rows(90)))
    labels: list[tuple[str, int, int]] = []
    analyze(log, progress=lambda label, done, total: labels.append((label, done, total)))
    assert [label for label, _, _ in labels] == [
        "overall",
        "tenant acme",
        "tenant globex",
        "tenant initech",
        "incidents",
        "done",
    ]
    assert all(total == 5 for _, _, total in labels)
    assert [done for _, done, _ in labels] == sorted(done for _, done, _ in labels)


def test_disabled_phases_draw_nothing(mooncake_file: Path) -> None:
    screen = io.StringIO()
    phases = Phases(False, file=screen)
    with phases, phases.steps("analysing") as step:
        step("overall", 0, 1)
        assert len(read_log(mooncake_file, progress=phases)) > 0
    assert screen.getvalue() == "" and not phases.enabled


def _stderr_on_a_terminal(args: list[str], stdin: bytes) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; (exit code, what the terminal got)."""
    master, slave = os.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    env.pop("TTY_COMPATIBLE", None)
    env.pop("FORCE_COLOR", None)
    with subprocess.Popen(
        [sys.executable, "-m", "controlplane.analysis", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        cwd=REPO,
        env=env,
    ) as process:
        os.close(slave)
        assert process.stdin is not None
        process.stdin.write(stdin)
        process.stdin.close()
        screen = bytearray()
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            screen += chunk
        code = process.wait(timeout=120)
    os.close(master)
    return code, screen.decode(errors="replace")


def test_progress_shows_on_a_terminal_only(mooncake_file: Path) -> None:
    data = mooncake_file.read_bytes()
    code, screen = _stderr_on_a_terminal(["analyze", "-", "--json"], data)
    assert code == 0
    assert "reading <stdin>" in screen and "analysing: overall" in screen
    assert "timestamps: milliseconds since start" in screen
    code, screen = _stderr_on_a_terminal(["analyze", "-", "--json", "--no-progress"], data)
    assert code == 0 and "analysing" not in screen and "timestamps:" in screen
