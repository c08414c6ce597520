"""One `burstgate serve` on PostgreSQL (the HA coordinator on, as always on
PostgreSQL) through a database outage: how many Admits are admitted, and
how many refused by what, before, during and after a cut (issue 30, item
12; docs/ha.md, "Database outages").

    .venv/bin/python bench/bench_db_outage.py                 # 20 s cut, refused connections
    .venv/bin/python bench/bench_db_outage.py --mode hang     # 20 s of silence
    .venv/bin/python bench/bench_db_outage.py --server-env BURSTGATE_HA_LONE_LEASE_TTL_S=5

A fresh database (BURSTGATE_TEST_PG_DSN or 127.0.0.1:5432), one tenant
with limits the load never reaches; the server's database connections go
through a TCP proxy (bench/_dbproxy.py). Unary Admits at ``--rate`` per
second, open loop, each admitted one completed at once (so nothing but the
database can refuse), for ``--before`` s, ``--cut`` s of outage and
``--after`` s. Prints a markdown table per phase; every Complete
acknowledged is then looked up in the ledger (none may be missing). Nothing
here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import grpc
import psycopg
from sqlalchemy.engine import make_url

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dbproxy import DbProxy  # noqa: E402
from _soak_server import ServerProc, free_port  # noqa: E402
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb  # noqa: E402
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc  # noqa: E402
from burstgate_client.redirects import not_owner  # noqa: E402
from soak import cli, create_db, drop_db, pg_dsn  # noqa: E402


async def drive(
    target: str, rate: float, phases: list[tuple[str, float]], on_phase: Mapping[str, object]
) -> tuple[dict[str, Counter[str]], list[str]]:
    """Admit at ``rate``/s through the phases; outcomes per phase, and the
    request ids whose Complete was acknowledged."""
    counts: dict[str, Counter[str]] = {name: Counter() for name, _ in phases}
    acked: list[str] = []
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.AdmissionServiceStub(ch)
        tasks: set[asyncio.Task[None]] = set()

        async def one(phase: str, rid: str) -> None:
            req = pb.AdmitRequest(tenant_id="bench", request_id=rid, prompt_tokens=10,
                                  max_tokens=10)  # fmt: skip
            try:
                resp = await stub.Admit(req, timeout=10)
            except grpc.aio.AioRpcError as exc:
                counts[phase]["NOT_OWNER" if not_owner(exc) is not None else exc.code().name] += 1
                return
            if resp.decision != pb.DECISION_ADMIT:
                counts[phase][pb.Reason.Name(resp.reason)] += 1
                return
            counts[phase]["admitted"] += 1
            try:
                await stub.Complete(pb.CompleteRequest(tenant_id="bench", request_id=rid,
                                                       prompt_tokens=10, generated_tokens=5),
                                    timeout=10)  # fmt: skip
            except grpc.aio.AioRpcError as exc:
                counts[phase][f"Complete {exc.code().name}"] += 1
                return
            acked.append(rid)

        n = 0
        for name, seconds in phases:
            hook = on_phase.get(name)
            if callable(hook):
                hook()
            start, first = time.monotonic(), n
            while (elapsed := time.monotonic() - start) < seconds:
                while n - first < int(elapsed * rate):
                    task = asyncio.create_task(one(name, f"r{n}"))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    n += 1
                await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
    return counts, acked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["refuse", "hang"], default="refuse")
    ap.add_argument("--rate", type=float, default=100.0, help="Admits/s")
    ap.add_argument("--before", type=float, default=10.0)
    ap.add_argument("--cut", type=float, default=20.0)
    ap.add_argument("--after", type=float, default=10.0)
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()

    url = create_db()
    u = make_url(url)
    proxy = DbProxy((u.host or "127.0.0.1", u.port or 5432))
    proxied = u.set(port=proxy.port).render_as_string(hide_password=False)
    logs = Path(tempfile.mkdtemp(prefix="bench-db-outage-"))
    try:
        cli(url, "migrate")
        cli(url, "tenant", "add", "bench", "--rate", "1000000", "--burst", "10000000")
        env = {"BURSTGATE_DATABASE_URL": proxied, "BURSTGATE_ADMISSION_AUTH": "false",
               "BURSTGATE_LEDGER_SPOOL_DIR": str(logs / "spool"),
               **dict(kv.split("=", 1) for kv in args.server_env)}  # fmt: skip
        server = ServerProc(env, free_port(), free_port(), logs)
        server.start()
        try:
            phases = [("before", args.before), ("cut", args.cut), ("after", args.after)]
            hooks = {"cut": lambda: proxy.cut(args.mode), "after": proxy.restore}
            counts, acked = asyncio.run(drive(server.target, args.rate, phases, hooks))
            time.sleep(3.0)  # the spool's replay after the restore
        finally:
            proxy.restore()
            server.stop()
        with psycopg.connect(pg_dsn(url)) as conn:
            rows = {r for (r,) in conn.execute("SELECT request_id FROM ledger_records")}
        missing = [r for r in acked if r not in rows]
    finally:
        proxy.close()
        drop_db(url)

    extra = " ".join(f"--server-env {kv}" for kv in args.server_env)
    print(f"`.venv/bin/python bench/bench_db_outage.py --mode {args.mode} --cut {args.cut:g}"
          f"{' ' + extra if extra else ''}`, {args.rate:g} Admits/s\n")  # fmt: skip
    print("| phase | seconds | admitted | refused (by what) |")
    print("|---|---:|---:|---|")
    for name, seconds in phases:
        c = counts[name]
        other = ", ".join(f"{k} {v:,}" for k, v in sorted(c.items()) if k != "admitted") or "0"
        print(f"| {name} | {seconds:g} | {c['admitted']:,} | {other} |")
    print(f"\nCompletes acknowledged {len(acked):,}; missing from the ledger {len(missing):,}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
