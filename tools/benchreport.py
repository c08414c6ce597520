"""BENCHMARKS.md, regenerated: every benchmark run at its standard size, its
report pasted in, and the targets table gathered from what they measured.

    .venv/bin/python tools/benchreport.py                # every benchmark (make bench)
    .venv/bin/python tools/benchreport.py --only bench_grpc,bench_sdk
    .venv/bin/python tools/benchreport.py --list         # the benchmarks and their sizes
    .venv/bin/python tools/benchreport.py --check        # the committed file is one of ours

Each benchmark in :data:`BENCHMARKS` runs as a person runs it (``python
bench/<script>.py <args>``, from the repository root, in its own process),
one after another so that no two share the 2 cores. Its stdout (a markdown
report: every script prints one) becomes its section, headings demoted,
under a line that says the command, the date, how long it took and the load
average before and after. A benchmark that measures one of the issues'
targets writes rows through ``bench/_summary.py``; the tool collects them
(``BURSTGATE_BENCH_SUMMARY``) into the targets table at the top, each row
with the figure, the baseline measured in the same run, the ratio and
whether the target was met.

``--only`` runs some benchmarks and keeps the other sections (and their
target rows, stored in the section as a comment) as they were: each section
carries its own date and load, so a partly regenerated file says which
figures are older. A benchmark that fails leaves its section saying so,
with the end of its stderr, and the tool exits 1 after writing the file.

The file is generated: edit this tool or the benchmarks, not the file. What
was measured before this tool existed, with the commands of the time, is in
docs/benchmarks-history.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
OUT = ROOT / "BENCHMARKS.md"
# Where the time goes for the targets missed: written by hand from the
# profiles (a profile is not a table a script can print), pasted in as it is.
ANALYSIS = ROOT / "bench" / "where-the-time-goes.md"
SUMMARY_ENV = "BURSTGATE_BENCH_SUMMARY"
TIMEOUT_S = 3600.0
BEGIN = "<!-- bench:{name} -->"
END = "<!-- /bench:{name} -->"
ROWS = "<!-- rows: {json} -->"


@dataclass(frozen=True)
class Benchmark:
    script: str  # bench/<script>.py
    args: tuple[str, ...]  # the standard size ("{pg}": the PostgreSQL admin DSN)
    title: str
    minutes: float  # about how long it runs on 2 quiet cores


PG = "{pg}"

# Every script in bench/ (tests/unit/test_benchreport.py holds the list to
# the directory), in the order of the file: the hot path first. Sizes are the
# scripts' defaults unless shown: shortened where a default runs for long
# (the soak's hour, the request log's 700 s) to keep `make bench` near
# 45 minutes; run a script with its defaults by hand for the long version.
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "bench_grpc",
        (),
        "gRPC: AdmitStream and unary Admit vs the empty handler and Redis + Lua",
        5,
    ),
    Benchmark("bench_sdk", (), "The Python SDK: micro-batched vs unary", 2),
    Benchmark(
        "bench_sidecar",
        ("--rate", "1000", "--stream", "--seconds", "20"),
        "The HTTP sidecar in front of an engine",
        3,
    ),
    Benchmark("bench_envoy", (), "Envoy's rate-limit service (RLS) door", 1),
    Benchmark(
        "bench_envoy_forward", (), "Envoy RLS through a replica that does not own the pool", 1
    ),
    Benchmark("bench_litellm", ("--seconds", "15"), "The LiteLLM proxy callback", 2),
    Benchmark("bench_service", (), "The admission service in process (no gRPC)", 2),
    Benchmark("bench_wire", (), "The AdmitStream wire codec vs the protobuf runtime", 1),
    Benchmark("bench_fastpath", (), "The compiled fast path vs its reference", 1),
    Benchmark("bench_reqlog", (), "The request table alone, both builds", 2),
    Benchmark("bench_request_log", ("--seconds", "150"), "Request-id memory and GC, in process", 3),
    Benchmark("bench_proto_shape", (), "Batch wire format", 1),
    Benchmark("bench_metrics", (), "Per-tenant metrics on the decision path", 1),
    Benchmark("bench_shaping", (), "Burst shaping: waiting calls", 2),
    Benchmark("bench_ledger", (), "The ledger writer", 4),
    Benchmark("bench_export_daily", (), "Daily export with the multiplier", 1),
    Benchmark("bench_analyze", (), "Burst analysis", 1),
    Benchmark("bench_grants", ("--dsn", PG), "Tenants that span cells: shares", 1),
    Benchmark("bench_notify", (), "Config fan-out and cell handoff", 2),
    Benchmark(
        "bench_pulse",
        ("--minutes", "2", "--pg-dsn", PG),
        "Pulse load against `burstgate serve` on PostgreSQL",
        3,
    ),
    Benchmark(
        "bench_autoscale",
        ("--duration", "3600", "--seeds", "0"),
        "Autoscaling signals in the simulator's loop (one seed, one hour)",
        3,
    ),
    Benchmark("bench_db_outage", (), "Admission through a database outage", 1),
    Benchmark(
        "ha_acceptance",
        ("--steady", "20", "--single", "15", "--kills", "5", "--config-changes", "5"),
        "Scale-out acceptance: failover, handoff, fan-out",
        4,
    ),
    Benchmark(
        "soak",
        ("--duration", "240", "--cut-every", "60", "--restart-every", "100"),
        "Soak: mixed load with database outages and restarts (4 minutes)",
        5,
    ),
)


def pg_admin_dsn() -> str:
    """The tests' PostgreSQL (BURSTGATE_TEST_PG_DSN, else the local one)."""
    return os.environ.get("BURSTGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def load_average() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"


def machine_lines() -> list[str]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as f:
        first = f.readline().split()
        if len(first) >= 2:
            mem = f", {int(first[1]) / 2**20:.0f} GiB"
    return [
        f"- machine: {os.cpu_count()} logical cores, {model or 'unknown CPU'}{mem}; "
        f"{platform.system()} {platform.release()}",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
    ]


def revision() -> str:
    """The commit measured, with a mark when the tree differs from it (the
    regenerated file itself aside)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!BENCHMARKS.md"], cwd=ROOT,
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "an unknown revision"
    return f"`{head}`" + (" with uncommitted changes" if dirty else "")


def demote(text: str, levels: int = 2) -> str:
    """Markdown headings moved ``levels`` down (a report's ``#`` under our ``##``)."""
    out = []
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


@dataclass
class Section:
    name: str
    body: str  # the section's text between its markers, rows comment excluded
    rows: list[dict[str, Any]]
    ok: bool


def run_one(b: Benchmark, python: str) -> Section:
    args = [a.replace(PG, pg_admin_dsn()) for a in b.args]
    shown = " ".join([".venv/bin/python", f"bench/{b.script}.py", *b.args]).replace(
        PG, "$PG_ADMIN_DSN"
    )
    with tempfile.TemporaryDirectory(prefix="benchreport-") as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        env = {**os.environ, SUMMARY_ENV: str(rows_path)}
        load_before = load_average()
        started = time.monotonic()
        print(f"[benchreport] {b.script}: {shown}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(
                [python, str(BENCH / f"{b.script}.py"), *args], cwd=ROOT, env=env,
                capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
            )  # fmt: skip
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, out, err = -1, _text(exc.stdout), _text(exc.stderr) + "\n(timed out)"
        took = time.monotonic() - started
        rows = []
        if rows_path.exists():
            rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line]
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        f"## {b.title} (`{b.script}`)",
        "",
        f"`{shown}` — {stamp}, at {revision()}, {took / 60:.1f} min; load average before "
        f"{load_before}, "
        f"after {load_average()}.",
        "",
    ]
    if code != 0:
        tail = "\n".join(err.strip().splitlines()[-30:])
        head += [f"**FAILED** (exit {code}); the end of its stderr:", "", "```", tail, "```", ""]
    body = "\n".join(head) + "\n" + demote(out.strip()) + "\n"
    for row in rows:
        row["bench"] = row.get("bench") or b.script
    return Section(b.script, body, rows, code == 0)


def _text(raw: str | bytes | None) -> str:
    if raw is None:
        return ""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def parse_sections(text: str) -> dict[str, Section]:
    """The sections of an existing file, by benchmark name."""
    found: dict[str, Section] = {}
    pattern = re.compile(
        r"<!-- bench:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /bench:(?P=name) -->", re.S
    )
    for m in pattern.finditer(text):
        body, rows = m["body"], []
        rm = re.search(r"^<!-- rows: (.*) -->\n", body, re.M)
        if rm:
            rows = json.loads(rm.group(1))
            body = body[: rm.start()] + body[rm.end() :]
        found[m["name"]] = Section(m["name"], body, rows, "**FAILED**" not in body)
    return found


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def targets_table(sections: list[Section]) -> list[str]:
    lines = [
        "| what | ours | unit | baseline (same run) | ratio | target | met | measured by |",
        "|---|---:|---|---|---:|---|---|---|",
    ]
    for s in sections:
        for r in s.rows:
            base = ""
            if r.get("baseline") is not None:
                base = f"{_fmt(r['baseline'])} ({r.get('baseline_name', '')})"
            ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
            met = {True: "**yes**", False: "no", None: "—"}[r.get("met")]
            what = r["what"] + (f" — {r['note']}" if r.get("note") else "")
            lines.append(
                f"| {what} | {_fmt(r['ours'])} | {r['unit']} | {base} | {ratio} | "
                f"{r['target']} | {met} | `{r.get('bench', s.name)}` |"
            )
    if len(lines) == 2:
        lines.append("| (no benchmark reported a target row) | | | | | | | |")
    return lines


def render(sections: list[Section], when: str) -> str:
    parts = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`tools/benchreport.py`): do not edit by hand. Each section "
        "is one benchmark's own report, run at its standard size, with its command, date and "
        "load average; figures are compared only within one run (ours against the baseline "
        "measured beside it), never across runs or machines. `tools/benchreport.py --only "
        "NAME` regenerates one section. What was measured before this file was generated, "
        "with the commands of the time, is in "
        "[docs/benchmarks-history.md](docs/benchmarks-history.md).",
        "",
        f"Last full or partial run: {when}.",
        *machine_lines(),
        "",
        "## Targets",
        "",
        "The rows the benchmarks measured against the issues' targets (`bench/_summary.py`).",
        "",
        *targets_table(sections),
        "",
    ]
    if ANALYSIS.exists():
        parts += [
            "## Where the time goes",
            "",
            f"(`{ANALYSIS.relative_to(ROOT)}`)",
            "",
            ANALYSIS.read_text(encoding="utf-8").rstrip("\n"),
            "",
        ]
    for s in sections:
        parts += [
            BEGIN.format(name=s.name),
            ROWS.format(json=json.dumps(s.rows, ensure_ascii=False)),
            s.body.rstrip("\n"),
            END.format(name=s.name),
            "",
        ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--list", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless --out has a section for every benchmark")  # fmt: skip
    a = p.parse_args(argv)
    names = [b.script for b in BENCHMARKS]
    if a.list:
        for b in BENCHMARKS:
            print(f"{b.script:22} ~{b.minutes:g} min  {' '.join(b.args)}")
        print(f"total ~{sum(b.minutes for b in BENCHMARKS):g} min")
        return 0
    old = parse_sections(a.out.read_text(encoding="utf-8")) if a.out.exists() else {}
    if a.check:
        missing = [n for n in names if n not in old]
        if missing:
            print(f"{a.out}: no section for {', '.join(missing)}", file=sys.stderr)
            return 1
        return 0
    only = [n for n in a.only.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        p.error(f"--only: no benchmark named {', '.join(unknown)} (see --list)")
    ok = True
    sections: list[Section] = []
    for i, b in enumerate(BENCHMARKS):
        if only and b.script not in only:
            if b.script in old:
                sections.append(old[b.script])
            continue
        s = run_one(b, sys.executable)
        ok = ok and s.ok
        sections.append(s)
        # written after each benchmark: an interrupted run keeps what it measured
        rest = [old[n] for n in names[i + 1 :] if n in old]
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        a.out.write_text(render(sections + rest, when), encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
