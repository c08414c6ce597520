"""Microbenchmark: the request table, compiled (``_reqlog_c``) vs. the reference (``_reqlog_py``).

Run on demand (not a test; nothing here asserts anything):

    .venv/bin/python bench/bench_reqlog.py [--sizes 100000 1000000] [--batch 100] [--tracemalloc]

For each size N, each build gets a fresh table and, timed one phase at a time:

* ``add_batch``: N admitted rows (state OPEN, decided in time order) in batches of
  ``--batch``, into a new table (which grows: page faults, index rehashes); ns per entry;
* ``replay_many``: N other request ids, none in the table (the common case: a new
  request), in batches of ``--batch`` against the full table; ns per entry;
* ``expire``, open rows: the TTL passes for all N in 100 ``expire`` calls, each releasing
  N/100 rows (returned as tuples); ns per row;
* ``add_batch`` (warm table): the N adds again into that table, now empty but grown;
* ``expire``, settled rows: the same with every row settled first (untimed), so rows
  leave through the settled-id window and nothing is returned; ns per row.

Ids are 32 hex characters (a uuid4's), over 100 tenants taken in turn, so no two
neighbours in a batch share a tenant (the compiled build hashes a tenant's prefix once
per run of equal tenants: this is its slow case).  The garbage collector runs as usual.

Bytes per row are the table's own ``footprint()["bytes"]`` over N rows, right after the
N adds: for the compiled build, what it has malloc'd (row block, keys, index, rings, at
their power-of-two capacities: tracemalloc does not see malloc); for the reference, its
``sys.getsizeof`` estimate (dict, tuples, FIFO entries, request ids, non-small ints).
``--tracemalloc`` also builds the reference's table once more under tracemalloc and
prints what it traced, to check that estimate (slow).
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
import tracemalloc
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from fastpath import _reqlog_c, _reqlog_py
from fastpath._reqlog_py import DECIDED_NS, NF, OPEN, STATE

T0 = 1_700_000_000 * 10**9
TTL = 600 * 10**9
TENANTS = 100


class Workload:
    """The same ids, rows and batches for both builds."""

    def __init__(self, n: int, batch: int) -> None:
        self.n = n
        self.batch = batch
        self.request_ids = [uuid.uuid4().hex for _ in range(n)]
        self.misses = [uuid.uuid4().hex for _ in range(n)]
        self.tenant_names = [f"tenant-{k:03d}" for k in range(TENANTS)]
        self.tenant_ids = [self.tenant_names[i % TENANTS] for i in range(n)]
        self.tkeys = (np.arange(n, dtype=np.int64) % TENANTS).astype(np.int64)
        self.rows = np.zeros((n, NF), dtype=np.int64)
        self.rows[:, STATE] = OPEN
        self.rows[:, DECIDED_NS] = T0 + np.arange(n, dtype=np.int64)
        self.rows[:, 3] = 1_000  # a reservation, a lane, ...: carried as given
        self.rows[:, 9] = 2

    def batches(self) -> range:
        return range(0, self.n, self.batch)


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


def _expire_all(table: Any, w: Workload, window: int) -> None:
    step = max(w.n // 100, 1)
    for k in range(step, w.n + step, step):
        table.expire(T0 + window + min(k, w.n) - 1)  # forgets rows decided/settled < k


def _open_rows(module: ModuleType, w: Workload, out: dict[str, float]) -> None:
    table = module.RequestTable(TTL, 10**9, 10**9)
    out["add_batch ns/entry"] = _timed(lambda: _fill(table, w)) / w.n
    out["bytes/row"] = table.footprint()["bytes"] / w.n
    out["replay_many ns/entry (no hits)"] = _timed(lambda: _replay_misses(table, w)) / w.n
    out["expire ns/row (open, released)"] = _timed(lambda: _expire_all(table, w, TTL)) / w.n
    # The same table again, now empty but grown: its memory is reused (no page faults, no
    # rehash), as once the id memory is full and rows expire as fast as others come.
    out["add_batch ns/entry (warm table)"] = _timed(lambda: _fill(table, w)) / w.n


def _settled_rows(module: ModuleType, w: Workload, out: dict[str, float]) -> None:
    window = 10**9
    table = module.RequestTable(TTL, 10**9, window)
    _fill(table, w)
    for i in range(w.n):
        table.settle(int(w.tkeys[i]), w.tenant_ids[i], w.request_ids[i], 900, 100, T0 + i)
    out["expire ns/row (settled)"] = _timed(lambda: _expire_all(table, w, window)) / w.n


def measure(module: ModuleType, w: Workload) -> dict[str, float]:
    out: dict[str, float] = {}
    _open_rows(module, w, out)
    gc.collect()
    _settled_rows(module, w, out)
    gc.collect()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--tracemalloc", action="store_true")
    args = parser.parse_args()
    print(f"# bench_reqlog: {platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}, batch {args.batch}, {TENANTS} tenants in turn")  # fmt: skip
    for n in args.sizes:
        w = Workload(n, args.batch)
        results: dict[str, dict[str, float]] = {}
        for name, module in (("python", _reqlog_py), ("cython", _reqlog_c)):
            results[name] = measure(module, w)
        print(f"\nN = {n:,}")
        print(f"{'':34} {'python':>12} {'cython':>12} {'python/cython':>14}")
        for key in results["python"]:
            py, c = results["python"][key], results["cython"][key]
            print(f"{key:34} {py:12.1f} {c:12.1f} {py / c:13.1f}x")
        if args.tracemalloc:
            print(f"{'bytes/row (python, tracemalloc)':34} {traced_bytes(w):12.1f}")


if __name__ == "__main__":
    main()
