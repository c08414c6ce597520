"""What one refresh of a replica's tenant shares costs (controlplane/store/
shares.py, docs/ha.md "Tenants that span cells"): the wall time of
``ShareStore.refresh`` for N tenants at once, one member and three, on a
scratch PostgreSQL database. Each tenant has an hourly quota (the heavier
case: its quota rows are read and written too).

    .venv/bin/python bench/bench_grants.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
                                           [--sizes 100 1000 10000]   # tiny: --sizes 100

Prints the median and p90 of 15 refreshes per size (after 3 warm-ups).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _pg import ADMIN_DSN, database

from controlplane.store.db import make_engine, upgrade
from controlplane.store.shares import Ask, ShareStore, Window

HOUR = 1_800_000_000 // 3600 * 3600


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default=ADMIN_DSN)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000], help="tenants")
    args = ap.parse_args()
    with database(args.dsn) as url:
        upgrade(url)
        engine = make_engine(url)
        store = ShareStore(engine)
        print("| tenants | members refreshing | median ms | p90 ms |")
        print("|---:|---:|---:|---:|")
        for n in args.sizes:
            for members in (1, 3):
                asks = [Ask(f"t{n}-{i}", 1000, hour=Window(HOUR, 0, 10**9), spend_bound=10**6)
                        for i in range(n)]  # fmt: skip
                times = []
                for k in range(18):
                    me = f"m{k % members}"
                    t0 = time.perf_counter()
                    store.refresh(me, asks, 5.0)
                    if k >= 3:
                        times.append((time.perf_counter() - t0) * 1000)
                times.sort()
                print(f"| {n:,} | {members} | {statistics.median(times):.1f} |"
                      f" {times[int(len(times) * 0.9)]:.1f} |")  # fmt: skip
        engine.dispose()


if __name__ == "__main__":
    main()
