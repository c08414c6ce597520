"""Memory of the request log under a steady Admit + Complete load (no gRPC).

    .venv/bin/python bench/bench_request_log.py [--rate 500] [--seconds 700] [--baseline DIR]

Drives ``AdmissionService`` in process with a fake clock: ``--rate`` Admit +
Complete pairs per simulated second for ``--seconds``, 100 tenants,
``expire()`` every second, once with the settled-id window equal to the
reservation TTL (600 s: the behaviour before the window existed) and once
with the default window, and prints the ids still remembered and the memory
``tracemalloc`` traces (plus, for the compiled build, the bytes the request
table has malloc'd, which tracemalloc cannot see). ``--gc N`` instead
admits N requests (never completed, so all remembered) and reports the
longest garbage-collector pause, with the server's start-up ``gc.freeze()``
done without and with ``AdmissionService.prepare_gc_freeze()`` first (each
in a fresh process).
``--baseline DIR``: each window is run again with an earlier compiled request table
(a ``_reqlog_c`` extension module built in DIR, as for ``bench_reqlog.py --baseline``)
in place of this tree's, in the same run, its rows marked "(before)".
Nothing here asserts anything.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tracemalloc
from decimal import Decimal
from typing import Any

from controlplane.domain import DEFAULT_LANES, TenantConfig
from controlplane.domain.policy import Policy
from controlplane.service import AdmissionService, ServiceLimits, records
from controlplane.settings import Settings
from controlplane.telemetry.gcpause import GcPauses
from fastpath import IMPLEMENTATION


def run(window_s: float, rate: int, seconds: int, table: Any = None) -> tuple[int, int]:
    now = [1_700_000_000 * 10**9]
    names = vars(records)  # the service's request log makes its table from this name
    saved = names["RequestTable"]
    if table is not None:
        names["RequestTable"] = table
    try:
        svc = AdmissionService(
            ServiceLimits.of(Settings(settled_id_window_s=window_s)), clock=lambda: now[0]
        )
    finally:
        names["RequestTable"] = saved
    tenants = [TenantConfig(f"t{i}", token_rate=Decimal(10**6), burst_tokens=10**8)
               for i in range(100)]  # fmt: skip
    svc.apply_config(tenants, list(DEFAULT_LANES), Policy(pool_gate=False))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for sec in range(seconds):
        for j in range(rate):
            tenant, rid = f"t{j % 100}", f"r{sec}-{j}"
            d = svc.admit(tenant, rid, "standard", 100, 100)
            svc.complete(tenant, rid, d.reservation_id, 100, 50)
        now[0] += 10**9
        svc.expire()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # tracemalloc sees Python's allocators only; the compiled request table
    # allocates its rows, index and expiry rings with malloc and counts them
    compiled = IMPLEMENTATION == "cython" or table is not None
    used += svc._log.table.footprint()["bytes"] if compiled else 0
    return svc.views.remembered_requests, used


def gc_pauses(n: int, prepare: bool) -> tuple[float, int]:
    """Longest collector pause (s) and collections while admitting ``n``."""
    now = [1_700_000_000 * 10**9]
    # no cap on open reservations: ``n`` admissions stay open, however many
    svc = AdmissionService(
        ServiceLimits.of(Settings(max_open_reservations=0, max_open_reservations_per_tenant=0)),
        clock=lambda: now[0],
    )
    tenants = [TenantConfig(f"t{i}", token_rate=Decimal(10**6), burst_tokens=10**12)
               for i in range(100)]  # fmt: skip
    svc.apply_config(tenants, list(DEFAULT_LANES), Policy(pool_gate=False))
    if prepare:
        svc.prepare_gc_freeze()
    gc.freeze()  # what serve_forever does once serving
    pauses = GcPauses().install()
    for i in range(n):
        svc.admit(f"t{i % 100}", f"r{i}", "standard", 10, 10)
        if i % 1000 == 0:
            now[0] += 10**6
    pauses.uninstall()
    return pauses.longest_s, sum(pauses.collections)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--seconds", type=int, default=700)
    ap.add_argument("--gc", type=int, default=0, help="admissions for the GC pause run")
    ap.add_argument("--baseline", metavar="DIR", help="an earlier _reqlog_c build's dir")
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        longest, count = gc_pauses(args.gc, args.prepare)
        print(f"{longest * 1e3:.2f} {count}")
        return
    if args.gc:
        print(f"| {args.gc:,} remembered ids | longest GC pause | collections |")
        print("|---|---:|---:|")
        for prepare in (False, True):
            cmd = [sys.executable, __file__, "--gc", str(args.gc), "--child"]
            out = subprocess.run(cmd + (["--prepare"] if prepare else []), check=True,
                                 capture_output=True, text=True).stdout.split()  # fmt: skip
            label = "gc.freeze() after prepare_gc_freeze()" if prepare else "gc.freeze() alone"
            print(f"| {label} | {out[0]} ms | {out[1]} |")
        return
    print(f"fastpath: {IMPLEMENTATION}")
    print("| settled-id window | ids remembered | memory | per remembered id |")
    print("|---|---:|---:|---:|")
    before = None
    if args.baseline:
        from bench_reqlog import load_baseline  # needs the compiled build: only then

        before = load_baseline(args.baseline).RequestTable
    for window in (600.0, Settings().settled_id_window_s):
        for label, table in [("", None)] + ([(" (before)", before)] if before else []):
            ids, used = run(window, args.rate, args.seconds, table)
            print(f"| {window:g} s{label} | {ids:,} | {used / 2**20:.1f} MiB "
                  f"| {used / max(ids, 1):.0f} B |")  # fmt: skip


if __name__ == "__main__":
    main()
