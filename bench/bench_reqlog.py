"""Microbenchmark: the request table, compiled (``_reqlog_c``) vs. the reference (``_reqlog_py``).

Run on demand (not a test; nothing here asserts anything):

    .venv/bin/python bench/bench_reqlog.py [--sizes 100000 1000000] [--batch 100] [--tracemalloc]
        [--baseline DIR] [--rounds 1] [--rss N] [--churn 5]

For each size N, each build gets a fresh table and, timed one phase at a time:

* ``add_batch``: N admitted rows (state OPEN, decided in time order) in batches of
  ``--batch``, into a new table (which grows: page faults, index rehashes); ns per entry;
* ``replay_many``: N other request ids, none in the table (the common case: a new
  request), in batches of ``--batch`` against the full table; ns per entry;
* ``expire``, open rows: the TTL passes for all N in 100 ``expire`` calls, each releasing
  N/100 rows (returned as tuples); ns per row;
* ``add_batch`` (warm table): the N adds again into that table, now empty but grown;
* ``settle``: every row settled, one call each; ns per row;
* ``expire``, settled rows: the same with every row settled first, so rows
  leave through the settled-id window and nothing is returned; ns per row;
* steady state: the N adds into a table whose TTL is N/2 rows, each batch followed by an
  ``expire``, so that from halfway on each batch forgets as many rows as it stores (the
  shape of a full id memory); ns per entry, for the add and the expire together.

Ids are 32 hex characters (a uuid4's), over 100 tenants taken in turn, so no two
neighbours in a batch share a tenant (the compiled build hashes a tenant's prefix once
per run of equal tenants: this is its slow case).  Rows are admissions as the service
makes them (reservation ids from a microsecond clock, a wait of up to 1 ms, the
multiplier's float bits, interned lane, pool and model).  The garbage collector runs as
usual.

``--baseline DIR`` adds a third build, measured side by side in the same run: a
``_reqlog_c`` extension module compiled elsewhere (e.g. from an earlier commit:
``git show REV:fastpath/_reqlog_c.pyx > DIR/_reqlog_c.pyx``, the same for the ``.pxd``,
then ``cythonize -i -3 DIR/_reqlog_c.pyx``), loaded as a top-level module from DIR.

``--rounds R`` measures every build R times, alternating their order, and prints the
medians (the machine is shared: compare builds within one run only).

``--rss N`` (default: the largest size, at most 200,000; 0: skip) measures the resident
memory of a table holding N ids in a steady state, in a fresh process per compiled
build: rows admitted in time order, each batch followed by ``expire`` with a TTL of N
rows, so that once full the table forgets as many rows as it takes; it then runs
``--churn`` times N more rows and reports the RSS per remembered id at full (RSS after
filling minus RSS before the table, over N) and how much the RSS grew during the churn
(it must not: freed slots are reused). This is the row "memory per remembered request
id" of the targets table (``bench/_summary.py``).

Bytes per row are the table's own ``footprint()["bytes"]`` over N rows, right after the
N adds: for the compiled build, what it has malloc'd (blocks of slots, index, rings, at
their capacities: tracemalloc does not see malloc); for the reference, its
``sys.getsizeof`` estimate (dict, tuples, FIFO entries, request ids, non-small ints).
``--tracemalloc`` also builds the reference's table once more under tracemalloc and
prints what it traced, to check that estimate (slow).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from _summary import record

from controlplane.service import records as R
from fastpath import _reqlog_c, _reqlog_py
from fastpath._reqlog_py import DECIDED_NS, NF, OPEN, STATE

T0 = 1_700_000_000 * 10**9
TTL = 600 * 10**9
TENANTS = 100
TARGET_BYTES = 64


class Workload:
    """The same ids, rows and batches for every build."""

    def __init__(self, n: int, batch: int, seed: int = 7) -> None:
        self.n = n
        self.batch = batch
        self.request_ids = [uuid.uuid4().hex for _ in range(n)]
        self.misses = [uuid.uuid4().hex for _ in range(n)]
        self.tenant_names = [f"tenant-{k:03d}" for k in range(TENANTS)]
        self.tenant_ids = [self.tenant_names[i % TENANTS] for i in range(n)]
        self.tkeys = (np.arange(n, dtype=np.int64) % TENANTS).astype(np.int64)
        self.rows = admissions(n, np.random.default_rng(seed))

    def batches(self) -> range:
        return range(0, self.n, self.batch)


def admissions(n: int, rng: np.random.Generator, start: int = 0) -> np.ndarray[Any, Any]:
    """``n`` admitted rows as the service stores them, decided 1 ns apart from T0+start."""
    rows = np.zeros((n, NF), dtype=np.int64)
    idx = np.arange(start, start + n, dtype=np.int64)
    rows[:, STATE] = OPEN
    rows[:, DECIDED_NS] = T0 + idx
    rows[:, R.ARRIVED_NS] = rows[:, DECIDED_NS] - rng.integers(0, 10**6, n)
    rows[:, R.RID] = T0 // 1000 + idx
    rows[:, R.RESERVED] = rng.integers(100, 20_000, n)
    rows[:, R.GRANTED] = rows[:, R.RESERVED] // 2
    rows[:, R.BUCKET] = rng.integers(0, 10**8, n)
    rows[:, R.HOUR] = -1
    rows[:, R.DAY] = rng.integers(0, 10**9, n)
    rows[:, R.LANE] = 2
    rows[:, R.SLOT] = idx % TENANTS
    rows[:, R.POOL] = 1
    rows[:, R.MODEL] = 3
    rows[:, R.MULTIPLIER] = R.float_bits(1.0)
    rows[:, R.WINDOW] = (T0 + idx) // (3600 * 10**9)
    rows[:, R.ACTUAL] = -1
    rows[:, R.SCORE_PPM] = rng.integers(0, 10**6, n)
    rows[:, R.FRESHNESS] = 1
    return rows


def load_baseline(directory: str) -> ModuleType:
    """The ``_reqlog_c`` extension module built in ``directory`` (top-level name)."""
    found = sorted(Path(directory).glob("_reqlog_c*.so"))
    if not found:
        raise SystemExit(f"--baseline: no _reqlog_c*.so in {directory}")
    spec = importlib.util.spec_from_file_location("_reqlog_c", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    fn()
    return float(time.perf_counter_ns() - start)


def _fill(table: Any, w: Workload) -> None:
    for s in w.batches():
        e = s + w.batch
        table.add_batch(w.tkeys[s:e], w.tenant_ids[s:e], w.request_ids[s:e], w.rows[s:e])


def _replay_misses(table: Any, w: Workload) -> None:
    for s in w.batches():
        e = s + w.batch
        table.replay_many(w.tkeys[s:e], w.tenant_ids[s:e], w.misses[s:e], T0 + w.n)


def _replay_hits(table: Any, w: Workload) -> None:
    for s in w.batches():
        e = s + w.batch
        table.replay_many(w.tkeys[s:e], w.tenant_ids[s:e], w.request_ids[s:e], T0 + w.n)


def _expire_all(table: Any, w: Workload, window: int) -> None:
    step = max(w.n // 100, 1)
    for k in range(step, w.n + step, step):
        table.expire(T0 + window + min(k, w.n) - 1)  # forgets rows decided/settled < k


def _open_rows(module: ModuleType, w: Workload, out: dict[str, float]) -> None:
    table = module.RequestTable(TTL, 10**9, 10**9)
    out["add_batch ns/entry"] = _timed(lambda: _fill(table, w)) / w.n
    out["bytes/row"] = table.footprint()["bytes"] / w.n
    out["replay_many ns/entry (no hits)"] = _timed(lambda: _replay_misses(table, w)) / w.n
    out["replay_many ns/entry (all hits)"] = _timed(lambda: _replay_hits(table, w)) / w.n
    out["expire ns/row (open, released)"] = _timed(lambda: _expire_all(table, w, TTL)) / w.n
    # The same table again, now empty but grown: its memory is reused (no page faults, no
    # rehash), as once the id memory is full and rows expire as fast as others come.
    out["add_batch ns/entry (warm table)"] = _timed(lambda: _fill(table, w)) / w.n


def _settled_rows(module: ModuleType, w: Workload, out: dict[str, float]) -> None:
    window = 10**9
    table = module.RequestTable(TTL, 10**9, window)
    _fill(table, w)
    settle = table.settle
    out["settle ns/row"] = _timed(
        lambda: [
            settle(int(w.tkeys[i]), w.tenant_ids[i], w.request_ids[i], 900, 100, T0 + i)
            for i in range(w.n)
        ]
    ) / w.n  # fmt: skip
    out["expire ns/row (settled)"] = _timed(lambda: _expire_all(table, w, window)) / w.n


def _steady(table: Any, w: Workload) -> None:
    for s in w.batches():
        e = s + w.batch
        table.add_batch(w.tkeys[s:e], w.tenant_ids[s:e], w.request_ids[s:e], w.rows[s:e])
        table.expire(T0 + min(e, w.n) - 1)


def measure(module: ModuleType, w: Workload) -> dict[str, float]:
    out: dict[str, float] = {}
    _open_rows(module, w, out)
    gc.collect()
    _settled_rows(module, w, out)
    gc.collect()
    steady = module.RequestTable(max(w.n // 2, 1), 10**9, 10**9)
    out["add_batch+expire ns/entry (steady)"] = _timed(lambda: _steady(steady, w)) / w.n
    return out


def traced_bytes(w: Workload) -> float:
    """Bytes per row tracemalloc sees for the reference's table after the N adds."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table = _reqlog_py.RequestTable(TTL, 10**9, 10**9)
    _fill(table, w)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del table
    return used / w.n


# --- RSS in a steady state ---------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(module: ModuleType, live: int, churn: int, batch: int) -> str:
    """Fill a table to ``live`` ids (TTL: ``live`` ns, one row a ns), then ``churn`` x
    ``live`` more; "rss_before rss_full rss_end rows_end bytes_end" as text."""
    rng = np.random.default_rng(3)
    total = live * (1 + churn)
    # Columns made a chunk at a time (their memory is freed and reused before the RSS
    # at full is read): only the table itself grows.
    tenants = [f"tenant-{k:03d}" for k in range(TENANTS)]
    table = None
    gc.collect()
    before = _rss()
    table = module.RequestTable(live, 10**9, live)
    full = 0
    chunk = 10 * batch
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        rows = admissions(n, rng, start)
        tkeys = (np.arange(start, start + n, dtype=np.int64) % TENANTS).astype(np.int64)
        tids = [tenants[i % TENANTS] for i in range(start, start + n)]
        rids = [f"{i:032x}" for i in range(start, start + n)]
        for s in range(0, n, batch):
            e = s + batch
            table.add_batch(tkeys[s:e], tids[s:e], rids[s:e], rows[s:e])
            table.expire(T0 + start + min(e, n) - 1)
        if not full and start + n >= live:
            del rows, tkeys, tids, rids
            gc.collect()
            full = _rss()
    end = _rss()
    return f"{before} {full} {end} {len(table)} {table.footprint()['bytes']}"


def rss_run(build: str, baseline: str | None, live: int, churn: int, batch: int) -> list[int]:
    cmd = [sys.executable, __file__, "--rss-child", build, "--rss", str(live),
           "--churn", str(churn), "--batch", str(batch)]  # fmt: skip
    if baseline:
        cmd += ["--baseline", baseline]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def rss_report(args: argparse.Namespace) -> None:
    live, churn = args.rss, args.churn
    builds = [("cython", None)] + ([("before", args.baseline)] if args.baseline else [])
    print(f"\nRSS, {live:,} ids remembered in a steady state, then {churn}x as many more")
    print("| build | rows at the end | RSS per id at full | table bytes per id | "
          "RSS growth over the churn |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    got: dict[str, float] = {}
    for build, path in builds:
        before, full, end, rows, table_bytes = rss_run(build, path, live, churn, args.batch)
        per_id = (full - before) / live
        growth = (end - full) / max(full - before, 1)
        got[build], got[f"{build} growth"] = per_id, growth
        print(f"| {build} | {rows:,} | {per_id:.0f} B | {table_bytes / max(rows, 1):.0f} B "
              f"| {(end - full) / 2**20:+.1f} MiB ({growth:+.1%}) |")  # fmt: skip
    flat = got["cython growth"] <= 0.02
    record(
        what="memory per remembered request id",
        ours=round(got["cython"]),
        unit="B of RSS per id",
        baseline=round(got["before"]) if "before" in got else None,
        baseline_name="the table before (the same ids, same run)" if "before" in got else "",
        target=f"<= {TARGET_BYTES} B; RSS flat once full",
        met=got["cython"] <= TARGET_BYTES and flat,
        note=f"RSS growth over {churn}x churn once full: {got['cython growth']:+.1%}",
        bench=f"bench/bench_reqlog.py --rss {live}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--baseline", metavar="DIR", help="an earlier _reqlog_c build's dir")
    parser.add_argument("--rss", type=int, help="ids for the RSS run; 0: none")
    parser.add_argument("--churn", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-python", action="store_true", help="compiled builds only")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss is None:
        args.rss = min(max(args.sizes), 200_000)
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.rss_child:
        module = baseline if args.rss_child == "before" else _reqlog_c
        assert module is not None
        print(rss_child(module, args.rss, args.churn, args.batch))
        return
    builds: list[tuple[str, ModuleType]] = [("python", _reqlog_py), ("cython", _reqlog_c)]
    if args.no_python:
        builds = builds[1:]
    if baseline is not None:
        builds.append(("before", baseline))
    print(f"# bench_reqlog: {platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}, batch {args.batch}, {TENANTS} tenants in turn, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for n in args.sizes:
        w = Workload(n, args.batch)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in builds}
        for r in range(args.rounds):
            for name, module in builds[r % len(builds) :] + builds[: r % len(builds)]:
                runs[name].append(measure(module, w))
        results = {
            name: {key: float(np.median([m[key] for m in got])) for key in got[0]}
            for name, got in runs.items()
        }
        print(f"\nN = {n:,}")
        extra = f" {'before':>12} {'cython/before':>14}" if baseline is not None else ""
        print(f"{'':34} {'python':>12} {'cython':>12} {'python/cython':>14}{extra}")
        for key in results["cython"]:
            c = results["cython"][key]
            py = results["python"][key] if "python" in results else float("nan")
            line = f"{key:34} {py:12.1f} {c:12.1f} {py / c:13.1f}x"
            if baseline is not None:
                b = results["before"][key]
                line += f" {b:12.1f} {c / b:13.2f}x"
            print(line)
        if args.tracemalloc:
            print(f"{'bytes/row (python, tracemalloc)':34} {traced_bytes(w):12.1f}")
    if args.rss:
        rss_report(args)


if __name__ == "__main__":
    main()
