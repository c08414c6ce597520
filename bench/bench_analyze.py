"""Benchmark ``burstgate analyze`` end to end on a synthetic 1,000,000-row log.

On demand, not a test:

    .venv/bin/python bench/bench_analyze.py            # text summary
    .venv/bin/python bench/bench_analyze.py --html     # plus the HTML report
    .venv/bin/python bench/bench_analyze.py --shape mooncake [--no-arrow]
    .venv/bin/python bench/bench_analyze.py --shape mooncake --readers

The log is written to a temporary directory: ledger-export columns
(ISO-8601 UTC timestamps, 20 tenants, decisions, queue waits) at about
100 requests/s for ~2.8 hours with a burst every ten minutes; or, with
``--shape mooncake``, the same arrivals as Mooncake JSON Lines (integer ms
from the start, input/output lengths, a ``hash_ids`` list per request).
Each run is a fresh process (interpreter start, imports, read, analyse,
render), timed from outside; peak RSS comes from the child's own
``getrusage``. Reports the median of ``--runs`` runs. ``--no-arrow`` turns
off the pyarrow JSON Lines fast path; ``--readers`` times only reading, in
this process: burstgate's reader against pyarrow's own CSV/JSON readers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS = 1_000_000
RATE = 100.0  # mean requests/s before bursts
TENANTS = 20
BURST_EVERY_S = 600  # one burst per 10-minute window
BURST_LENGTH_S = 30
BURST_FACTOR = 4.0  # bursts run at 4x the base rate
T0 = np.datetime64("2025-01-06T09:00:00", "us")


def generate(path: Path, rows: int, seed: int = 7) -> None:
    """Write a synthetic ledger-style CSV with exactly ``rows`` requests."""
    rng = np.random.default_rng(seed)
    seconds = int(rows / RATE * 1.1) + 1
    rates = np.full(seconds, RATE)
    for start in range(300, seconds, BURST_EVERY_S):
        rates[start : start + BURST_LENGTH_S] *= BURST_FACTOR
    counts = rng.poisson(rates)
    offsets = np.repeat(np.arange(seconds, dtype=np.float64), counts)
    offsets = np.sort(offsets + rng.random(offsets.size))[:rows]
    n = offsets.size
    stamps = T0 + (offsets * 1e6).astype("timedelta64[us]")
    iso = np.char.add(np.datetime_as_string(stamps, unit="us"), "Z")
    # Zipf-like tenant mix: a few big tenants, a long tail.
    weights = 1.0 / np.arange(1, TENANTS + 1)
    tenant = rng.choice(TENANTS, size=n, p=weights / weights.sum())
    prompt = np.clip(rng.lognormal(6.5, 1.0, n), 1, 32_000).astype(np.int64)
    output = np.clip(rng.lognormal(4.8, 0.9, n), 1, 4_000).astype(np.int64)
    wait = rng.exponential(20.0, n)
    decision = np.where(rng.random(n) < 0.97, "admitted", "rejected")
    with path.open("w", encoding="utf-8") as handle:
        handle.write("tenant_id,arrival_ts,prompt_tokens,output_tokens,decision,queue_wait_ms\n")
        chunk = 100_000  # keeps the formatted strings for one chunk only
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            lines = [
                f"tenant-{t:02d},{s},{p},{o},{d},{w:.1f}"
                for t, s, p, o, d, w in zip(
                    tenant[lo:hi].tolist(),
                    iso[lo:hi].tolist(),
                    prompt[lo:hi].tolist(),
                    output[lo:hi].tolist(),
                    decision[lo:hi].tolist(),
                    wait[lo:hi].tolist(),
                    strict=True,
                )
            ]
            handle.write("\n".join(lines) + "\n")


def to_mooncake(csv_path: Path, out: Path) -> None:
    """The ledger-style log's arrivals and lengths as Mooncake JSON Lines."""
    import csv

    with csv_path.open(encoding="utf-8") as source, out.open("w", encoding="utf-8") as sink:
        rows = csv.reader(source)
        next(rows)
        first: np.datetime64 | None = None
        for row in rows:
            stamp = np.datetime64(row[1].rstrip("Z"), "us")
            first = stamp if first is None else first
            ms = int((stamp - first) // np.timedelta64(1, "ms"))
            prompt, output = int(row[2]), int(row[3])
            blocks = list(range(prompt // 512 + 1))
            sink.write(
                json.dumps(
                    {
                        "timestamp": ms,
                        "input_length": prompt,
                        "output_length": output,
                        "hash_ids": blocks,
                    }
                )
                + "\n"
            )


def readers(path: Path, shape: str) -> None:
    """Reading only, CPU seconds in this process (best of 3): ours vs pyarrow's."""
    import pyarrow.csv as pa_csv  # type: ignore[import-untyped,import-not-found,unused-ignore]
    import pyarrow.json as pa_json  # type: ignore[import-untyped,import-not-found,unused-ignore]

    from controlplane.analysis.reader import read_log

    def best(run: object) -> float:
        times = []
        for _ in range(3):
            started = time.process_time()
            run()  # type: ignore[operator]
            times.append(time.process_time() - started)
        return min(times)

    results: dict[str, float] = {}
    if shape == "ledger":
        results["burstgate read_log (csv module + NumPy fast path)"] = best(lambda: read_log(path))
        results["pyarrow.csv.read_csv (typed, all columns)"] = best(lambda: pa_csv.read_csv(path))
    else:
        results["burstgate read_log (pyarrow JSON fast path)"] = best(lambda: read_log(path))
        os.environ["BURSTGATE_ANALYZE_ARROW"] = "0"
        results["burstgate read_log (row by row: json.loads)"] = best(lambda: read_log(path))
        del os.environ["BURSTGATE_ANALYZE_ARROW"]
        results["pyarrow.json.read_json (inferred schema, all fields)"] = best(
            lambda: pa_json.read_json(path)
        )
    for label, seconds in results.items():
        print(f"{label}: {seconds:.2f} s CPU")


def child(argv: list[str]) -> None:
    """Run the CLI in this process; print peak RSS and CPU time as the last line."""
    import typer

    from controlplane.analysis.cli import register

    app = typer.Typer()
    register(app)
    try:
        app(args=argv, standalone_mode=False)
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        # ru_maxrss is KiB on Linux; CPU time is steadier than wall time on a busy machine.
        summary = {"max_rss_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime}
        print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--html", action="store_true", help="also write the HTML report")
    parser.add_argument("--shape", choices=("ledger", "mooncake"), default="ledger")
    parser.add_argument("--no-arrow", action="store_true", help="no pyarrow JSON fast path")
    parser.add_argument("--readers", action="store_true", help="time reading only")
    parser.add_argument("--generate", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    if args.generate is not None:
        generate(Path(args.generate), args.rows)
        return
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ledger.csv"
        started = time.perf_counter()
        # Generate in a child too: Linux carries ru_maxrss across fork+exec,
        # so a parent that grew while generating would inflate every child's
        # reported peak.
        subprocess.run(
            [sys.executable, __file__, "--generate", str(log), "--rows", str(args.rows)],
            cwd=repo,
            check=True,
        )
        if args.shape == "mooncake":
            to_mooncake(log, Path(tmp) / "trace.jsonl")
            log.unlink()
            log = Path(tmp) / "trace.jsonl"
        size_mb = log.stat().st_size / 1e6
        elapsed = time.perf_counter() - started
        print(f"generated {args.rows:,} rows ({size_mb:.0f} MB, {args.shape}) in {elapsed:.1f} s")
        if args.readers:
            readers(log, args.shape)
            return
        cli = ["analyze", str(log), "--no-progress"]
        if args.html:
            cli += ["--html", str(Path(tmp) / "report")]
        timings: list[float] = []
        peaks: list[float] = []
        cpu: list[float] = []
        for run in range(args.runs):
            started = time.perf_counter()
            env = {**os.environ}
            if args.no_arrow:
                env["BURSTGATE_ANALYZE_ARROW"] = "0"
            done = subprocess.run(
                [sys.executable, __file__, "--child", *cli],
                cwd=repo,
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            timings.append(time.perf_counter() - started)
            usage = json.loads(done.stdout.strip().splitlines()[-1])
            peaks.append(usage["max_rss_mib"])
            cpu.append(usage["cpu_s"])
            print(
                f"run {run + 1}: {timings[-1]:.2f} s wall, {cpu[-1]:.2f} s CPU, "
                f"peak RSS {peaks[-1]:.0f} MiB"
            )
        print(
            f"burstgate {' '.join(cli[:1] + cli[2:])} on {args.rows:,} {args.shape} rows"
            f"{' (no arrow)' if args.no_arrow else ''}: "
            f"median {statistics.median(timings):.2f} s wall, {statistics.median(cpu):.2f} s CPU, "
            f"peak RSS {max(peaks):.0f} MiB (median of {args.runs} runs)"
        )


if __name__ == "__main__":
    main()
