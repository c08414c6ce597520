"""Every benchmark in bench/ still runs, at a tiny size (BENCHMARKS.md: a
benchmark that no longer runs is a bug).

Each script runs as a person runs it: ``python bench/<name>.py <tiny
args>`` in its own process, from the repository root, with the same
external binaries (Envoy and LiteLLM from the venv, redis-server from the
OS) and, for those that need PostgreSQL, the tests' server
(BURSTGATE_TEST_PG_DSN or 127.0.0.1:5432, which bench/_pg.py and the other
scripts read) in a database of the script's own making. Asserted: it exits
0 and prints what it is for (its tables' rows, its verdict lines), so a
script that crashes, or runs but measures nothing (a server refusing every
call, a baseline silently left out), fails here. Never a time or a figure:
at this size the figures mean nothing.

``BENCHMARKS`` lists every script with its tiny arguments; a new script
in bench/ (a name not starting with ``_``) fails
``test_every_benchmark_is_listed`` until it is added. The list is run in two halves, this module and
test_benchmarks_run_part2.py (``part``), so that ``pytest -n 2 --dist
loadfile`` (``make test``) runs them on both workers: about 80 s of work
each on this project's 2-core machine (85 s wall for both, quiet machine),
split to balance.

``make bench-smoke`` runs these modules alone (the marker ``bench_smoke``);
``make test`` runs them with the rest of the suite.

One by hand: the command in the failure message, e.g.
``.venv/bin/python bench/bench_grpc.py --quick --rounds 1 --seconds 0.2``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bench_smoke  # `make bench-smoke` runs these alone

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TIMEOUT_S = 240.0  # each run; pytest-timeout's 300 s is the whole test's
TAIL = 4000  # characters of each stream shown when a run fails


@dataclass(frozen=True)
class Bench:
    script: str  # bench/<script>.py
    args: tuple[str, ...]  # the tiny size; "{tmp}" = the test's tmp_path, "{pg}" = admin DSN
    expect: tuple[str, ...]  # regular expressions (multiline) that stdout must match
    part: int  # 1: this module, 2: test_benchmarks_run_part2.py
    postgres: bool = False
    reject: tuple[str, ...] = ()  # ... and must not match
    env: tuple[tuple[str, str], ...] = ()


BENCHMARKS = (
    # ---------------------------------------------------------------- part 1
    # One restart (SIGKILL) at 1 s, one database cut at 6.5-7 s, 2 s of load
    # after it (a restart due within 5 s of a cut moves past it: out of the run).
    Bench("soak", (
        "--duration", "9", "--tail", "2", "--restart-every", "1", "--sigkill-at", "1",
        "--cut-every", "6.5", "--cut-length", "0.5", "--ttl", "2", "--rate", "100",
        "--report-every", "2", "--sample-every", "1",
        "--server-env", "BURSTGATE_SHUTDOWN_GRACE_S=1", "--out", "{tmp}/soak",
    ), (
        r"^Events: \d+ s restart-sigkill, \d+ s cut-refuse, \d+ s restore, \d+ s stop-sigterm\.$",
        r"^\| Completes acknowledged OK \(distinct requests\) \| [1-9][\d,]* \|$",
        r"^\| acknowledged and missing from the export \| 0 \|$",
        r"^Reconciliation OK\.",
    ), part=1, postgres=True),
    Bench("bench_pulse", ("--minutes", "0.01", "--pg-dsn", "{pg}"), (
        r"^[\d,]+ requests, pulse 20 -> 80/s 30 s every 90 s, 0\.01 min$",
        r"^\| burstgate serve \(PostgreSQL\) \| all \| [1-9][\d,]* \| [1-9]",
        r"^\| empty handler \| all \| [1-9][\d,]* \| [1-9]",
        r"^CPU ratio \(burstgate / empty\): [\d.]+$",
    ), part=1, postgres=True),
    Bench("bench_grpc", ("--quick", "--rounds", "1", "--seconds", "0.2"), (
        r"^# burstgate gRPC benchmark$",
        # every server in both tables, the Redis+Lua baseline included (the
        # script leaves it out, with a word on stderr, without redis-server)
        *(rf"^\| {size} \| {server} \| [1-9]" for size in ("100", "1,000", "2,000")
          for server in ("ours", "empty", "redis")),
        r"^\| 1,000 \| \*\*ours/redis\*\* \| \*\*[\d.]+x\*\* \|",
        r"^## Targets \(core admission\)$",
    ), part=1),
    Bench("bench_litellm", ("--sequential", "4", "--concurrency", "2", "--seconds", "0.5"), (
        r"^One at a time \(4 requests, alternating\):$",
        r"^\| litellm \| [1-9]",
        r"^\| litellm\+burstgate \| [1-9]",
        r"^2 concurrent clients, 0\.5 s, alternating:$",
    ), part=1),
    Bench("bench_sdk", (
        "--quick", "--seconds", "0.2", "--callers", "8", "--rates", "200", "--quiesce", "0.25",
    ), tuple(
        rf"^\| {load} \| {mode} \| [1-9]" for load in ("200/s", "N=8")
        for mode in ("sdk", "sdk-nowait", "unary")
    ), part=1),
    Bench("bench_sidecar", (
        "--rate", "50", "--seconds", "1", "--warmup", "0.5", "--slice", "0.5",
        "--sequential", "10",
    ), (
        r"^One at a time \(10 requests, alternating\):$",
        r"^\| sidecar \| [1-9]",
        r"^Open loop, 50 req/s, paths alternating every 0\.5 s, 1 s measured",
        r"^sidecar process CPU: [\d.]+ s",
    ), part=1),
    Bench("bench_envoy", ("--requests", "20"), (
        r"^One at a time \(20 requests, alternating;",
        r"^\| envoy \| [1-9]",
        r"^\| envoy\+burstgate \| [1-9]",
        r"^control plane CPU: [\d.]+ s, .* reservations left open: \d+$",
    ), part=1),
    Bench("bench_fastpath", ("--round-ms", "1", "--cap", "20000"), (
        r"^\| fastpath compiled `admit` \| [\d,]+ \| [\d.,]+ \|",
        r"^\| fastpath compiled `admit_batch`, batch 1000 \| [\d,]+ \|",
        r"^\| limits MovingWindow \+ MemoryStorage, `hit\(cost=N\)` \| [\d,]+ \|",
        r"^\| pyrate-limiter .* \| [\d.]+x \|$",
        r"^\| `backpressure_score_ppm\(\.\.\.\)` \| 32 \| [\d.,]+ \| [\d.,]+ \| [\d.]+x \|$",
    ), part=1),
    Bench("bench_grants", ("--dsn", "{pg}", "--sizes", "100"), (
        r"^\| 100 \| 1 \| [\d.]+ \| [\d.]+ \|$",
        r"^\| 100 \| 3 \| [\d.]+ \| [\d.]+ \|$",
    ), part=1, postgres=True),
    Bench("bench_analyze", ("--rows", "2000", "--runs", "1"), (
        r"^generated 2,000 rows \(",
        r"^run 1: [\d.]+ s wall, [\d.]+ s CPU, peak RSS \d+ MiB$",
        r"^burstgate analyze --no-progress on 2,000 ledger rows: median .*\(median of 1 runs\)$",
    ), part=1),
    Bench("bench_export_daily", ("--rows", "2000", "--runs", "1"), (
        r"^SQLite, 2,000 records, median of 1:$",
        *(rf"^  {what} +[\d.]+ s +[\d,]+ records/s$"
          for what in ("group-by", "daily", "request", "margin")),
    ), part=1),
    Bench("bench_reqlog", ("--sizes", "1000"), (
        r"^N = 1,000$",
        r"^add_batch ns/entry +[\d.]+ +[\d.]+ +[\d.]+x$",
        r"^expire ns/row \(settled\) +[\d.]+ +[\d.]+ +[\d.]+x$",
    ), part=1),
    Bench("bench_wire", ("--sizes", "10", "--rounds", "1", "--round-ms", "1"), (
        r"^# AdmitStream wire codec: compiled reader/writer vs\. the protobuf runtime$",
        *(rf"^\| 10 \| {what} \| [\d,]+ \([\d.,]+\) \| [\d,]+ \([\d.,]+\) \| [\d.]+x \|"
          for what in ("read", "write")),
    ), part=1),
    Bench("bench_request_log", ("--rate", "10", "--seconds", "130"), (
        r"^\| 600 s \| 1,300 \| [\d.]+ MiB \|",  # 130 s of ids: all within 600 s
        r"^\| (?!600 s)[\d.]+ s \| [\d,]+ \| [\d.]+ MiB \|",
    ), part=1),
    Bench("bench_proto_shape", (), (
        r"^\| row-shaped submessages \| [\d,]+ \|$",
        r"^\| packed columns \(AdmitBatch\) \| [\d,]+ \|$",
        r"^\| ratio rows/columns \| [\d.]+x \|$",
    ), part=1),
    Bench("bench_service", ("--rounds", "1", "--n", "1000"), (
        r"^\| admit\+complete \| [\d,]+ \|$",
        r"^\| admit_or_wait \(backlog\) \| [\d,]+ \|$",
        r"^\| admit_batch 1000, 4 tenants \| [\d,]+ \|$",
    ), part=1),
    # Ten minutes of the diurnal trace on two engines, all four autoscalers.
    Bench("bench_autoscale", (
        "--seeds", "3", "--duration", "600", "--engines", "2", "--load", "0.45",
        "--startup", "30", "--scale-down-delay", "60", "--jobs", "1",
    ), (
        r"^\| 3 \| off \| [\d.]+ / [\d.]+ / [\d.]+ \| [1-9][\d,]* \| 100% \| 2 \|",
        r"^\| 3 \| reactive \| ",
        r"^\| 3 \| predictive \| .* \| \d+ \(\d+\)",
        r"^\| 3 \| queue-length \| ",
        r"^- seed 3: predictive premium [\d.]+ vs off [\d.]+ ",
    ), part=1),
    Bench("bench_metrics", ("--rounds", "1", "--n", "1000"), (
        r"^\| admit\+complete \| [\d,]+ \| [\d,]+ \| [\d.]+x \|$",
        r"^\| admit_batch 1000, 4 tenants \| [\d,]+ \| [\d,]+ \| [\d.]+x \|$",
    ), part=1),
    # ---------------------------------------------------------------- part 2
    # One kill only: the SIGSTOP, link cut and SIGTERM go through the same
    # Faults code in tests/integration/ha/test_acceptance.py, which asserts
    # on them; each costs this tiny run ~10 s of CI.
    Bench("ha_acceptance", (
        "--ttl", "1", "--margin", "0.25", "--rate", "300", "--single", "1", "--steady", "1",
        "--warmup", "1", "--config-changes", "1", "--kills", "1", "--stops", "0", "--cuts", "0",
        "--terms", "0", "--out", "{tmp}/ha",
    ), (
        # (it exits 1 when a figure that must be zero is not)
        r"^\| cells decided by two owners at once \(1x kill -9, 0x SIGSTOP, 0x link cut, "
        r"0x SIGTERM\) \| 0 \| 0 overlapping intervals of [1-9]",
        r"^\| acknowledged Completes lost / duplicated \| 0 / 0 \| 0 / 0 of [1-9]",
        r"^\| config change visible on all replicas \| .* \(1 changes\) \|$",
        r"^load: [1-9]\d* Admits sent",
    ), part=2, postgres=True, env=(("BURSTGATE_SHUTDOWN_GRACE_S", "1"),)),
    # A lone serve through a 1 s database cut (issue 30 item 12): it keeps
    # admitting, and every acknowledged Complete reaches the ledger (it exits
    # 1 when one is missing).
    Bench("bench_db_outage", (
        "--mode", "hang", "--rate", "40", "--before", "1", "--cut", "1.5", "--after", "1",
    ), (
        r"^\| cut \| 1\.5 \| [1-9][\d,]* \| ",
        r"^Completes acknowledged [1-9][\d,]*; missing from the ledger 0$",
    ), part=2, postgres=True),
    Bench("bench_ledger", (
        "--records", "2000", "--batch", "500", "--window", "1000", "--rounds", "1",
        "--admit-rounds", "1", "--seconds", "1", "--rate", "200",
    ), (
        r"^\| plain psycopg text COPY, 500 rows per COMMIT \| [\d,]+ \|",
        r"^\| `LedgerWriter`, one batch at a time .* \| [\d,]+ \| [\d.]+ \|",
        r"^\| `LedgerWriter`, up to 3 batches at once .* \| [\d,]+ \| [\d.]+ \|",
        r"^\| off \(idle\) \| [\d,]+ \| [1-9][\d,]* \|",
        r"^\| 200/s, durable \(the writer as it is\) \| [\d,]+ \| [1-9][\d,]* \|",
    ), part=2, postgres=True),
    Bench("bench_shaping", ("--quick", "--rounds", "1"), (
        r"^\| 1,000 waiting \| [1-9][\d,]* \|",
        r"^\| no waiters \| [1-9][\d,]* \|",
        r"^\| 1,000 \| 1,000 waiting \| [1-9]",
        r"^\| 1,000 \| idle \| [1-9]",
        r"^## Targets \(burst shaping\)$",
        # every server decision an admission (a prober refused as an unknown
        # tenant, or held by the pool gate, measured refusals, not queueing)
        r"^\| after the run \| .* \| OK [\d,]+ \|$",
    ), part=2, reject=(r"only 0\.0% of free's calls admitted",)),
    Bench("bench_notify", ("--n", "2", "--poll-n", "1", "--rounds", "1"), (
        r"^config, LISTEN on, poll 30 s: applied +n= +2 ",
        r"^config, LISTEN on, poll 2 s: applied +n= +2 ",
        r"^config, poll only \(2 s\): applied +n= +1 ",
        r"^handoff TTL 5 s, woken by NOTIFY +n= +1 ",
        r"^handoff TTL 5 s, own tick only +n= +1 ",
    ), part=2, postgres=True),
    Bench("bench_envoy_forward", ("--requests", "20"), (
        r"^ShouldRateLimit, request path, one at a time, 20 timed calls",
        r"^local +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$",
        r"^forwarded +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$",
        r"^forwarding adds -?[\d.]+ ms at the median",
    ), part=2, postgres=True),
)  # fmt: skip


def params(part: int) -> list[Any]:
    """The benchmarks of one half, marked as the suite marks such tests."""
    out = []
    for b in BENCHMARKS:
        if b.part == part:
            marks = [pytest.mark.slow, pytest.mark.postgres] if b.postgres else [pytest.mark.slow]
            out.append(pytest.param(b, id=b.script, marks=marks))
    return out


def run(bench: Bench, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Run ``bench`` at its tiny size; fail with its command and output
    unless it exits 0, prints every ``expect`` and no ``reject``."""
    env = {**os.environ, **dict(bench.env)}
    pg = ""
    if bench.postgres:
        pg = str(request.getfixturevalue("pg_admin_dsn"))
        env["BURSTGATE_TEST_PG_DSN"] = pg
    args = [a.format(tmp=tmp_path, pg=pg) for a in bench.args]
    cmd = [sys.executable, str(BENCH / f"{bench.script}.py"), *args]
    shown = " ".join([*(f"{k}={v}" for k, v in bench.env), ".venv/bin/python",
                      f"bench/{bench.script}.py", *args])  # fmt: skip
    # A session of its own: a run past its time is killed with the servers it started.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process of another session holds the pipes
            out, err = "", ""
        pytest.fail(f"`{shown}` did not end within {TIMEOUT_S:.0f} s{_tails(out, err)}")
    assert proc.returncode == 0, f"`{shown}` exited {proc.returncode}{_tails(out, err)}"
    missing = [p for p in bench.expect if not re.search(p, out, re.MULTILINE)]
    assert not missing, f"`{shown}` printed no line matching {missing}{_tails(out, err)}"
    found = [p for p in bench.reject if re.search(p, out, re.MULTILINE)]
    assert not found, f"`{shown}` printed {found}{_tails(out, err)}"


def _tails(out: str, err: str) -> str:
    return f"\n--- stdout (end) ---\n{out[-TAIL:]}\n--- stderr (end) ---\n{err[-TAIL:]}"


def test_every_benchmark_is_listed() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    listed = [b.script for b in BENCHMARKS]
    assert sorted(listed) == sorted(scripts), "add the new benchmark to BENCHMARKS, tiny"
    assert {b.part for b in BENCHMARKS} == {1, 2}


@pytest.mark.parametrize("bench", params(1))
def test_benchmark_runs_tiny(bench: Bench, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    run(bench, tmp_path, request)
