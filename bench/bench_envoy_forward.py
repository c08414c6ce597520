"""What forwarding adds to Envoy's rate-limit call when Envoy reaches a
replica that does not own the pool (issue 16; docs/envoy.md, "Several
replicas"): a ShouldRateLimit decided where it lands (the owner) against
the same call sent to the other replica, which forwards it to the owner,
side by side in one run.

    .venv/bin/python bench/bench_envoy_forward.py [--requests 2000]

Needs PostgreSQL (BURSTGATE_TEST_PG_DSN, default the local test server);
makes a database of its own and drops it. Two ``burstgate serve`` processes
(r0, r1) on it, admission auth on (a sidecar key, checked on both hops),
deploy/envoy/burstgate-envoy.yaml as the mapping. Eight pools (one tenant
each); one owned by each replica is used. The client is this process
(grpc.aio, one channel per replica), one call at a time, cycling through
four kinds after 200 to warm up:

- ``local``: the request-path call to the pool's owner;
- ``forwarded``: the same call to the other replica;

each followed (untimed) by its stream-done call to the same replica, so
nothing stays reserved. Latency is the request-path call's, as Envoy sees
it (its stream-done call is fire and forget). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import grpc
from _pg import database
from bench_sidecar import free_port
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore

ROOT = Path(__file__).resolve().parents[1]
POOLS = [f"p{i}" for i in range(8)]
OK = rls.RateLimitResponse.OK


def prepare(url: str) -> str:
    upgrade(url)
    engine = make_engine(url)
    try:
        repo = ConfigRepository(engine)
        big = {"token_rate": Decimal(1_000_000), "burst_tokens": 1_000_000_000}
        repo.add_tenant(TenantConfig("acme", **big))  # type: ignore[arg-type]
        for pool in POOLS:  # the config names the pools: their cells exist at start
            repo.add_tenant(TenantConfig(f"t-{pool}", pool=pool, **big))  # type: ignore[arg-type]
        key, _ = KeyStore(engine).create_key(
            "bench", Role.SIDECAR, Actor("local:bench", "local"), tenants=["*"], pools=["*"]
        )
    finally:
        engine.dispose()
    return key


def serve(url: str, member: str, port: int, spool: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {
        "BURSTGATE_DATABASE_URL": url, "BURSTGATE_HOST": "127.0.0.1",
        "BURSTGATE_PORT": str(port), "BURSTGATE_METRICS_PORT": "-1",
        "BURSTGATE_HA_MEMBER_ID": member, "BURSTGATE_LEDGER_SPOOL_DIR": str(spool),
        "BURSTGATE_ENVOY_RLS_CONFIG": str(ROOT / "deploy" / "envoy" / "burstgate-envoy.yaml"),
        "BURSTGATE_LOG_LEVEL": "warning",
    }  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "controlplane", "serve"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def owners(target: str, key: str, members: int) -> dict[str, str]:
    """pool -> the owner's address, once every pool has one and the cells
    are spread over ``members`` replicas."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(target) as ch:
                answer = pb_grpc.AdmissionServiceStub(ch).GetCellOwners(
                    pb.GetCellOwnersRequest(),
                    metadata=[("authorization", f"Bearer {key}")],
                    timeout=5,
                )
            got = {cell.cell: cell.owner_address for cell in answer.cells}
            if all(got.get(p) for p in POOLS) and len({got[p] for p in POOLS}) == members:
                return got
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise SystemExit("the cells were not spread over the replicas within 60 s")


def ask(rid: str, pool: str, done: bool = False) -> rls.RateLimitRequest:
    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    for k, v in (("tenant", "acme"), ("request_id", rid), ("pool", pool)):
        d.entries.add(key=k, value=v)
    if done:
        d.entries.add(key="phase", value="response")
        d.entries.add(key="prompt_tokens", value="10")
        d.entries.add(key="completion_tokens", value="20")
        d.hits_addend.value = 30
    return req


async def run(targets: dict[str, str], pools: dict[str, str], key: str, n: int,
              ) -> dict[str, list[float]]:  # fmt: skip
    """``pools``: member address -> a pool it owns."""
    md = [("authorization", f"Bearer {key}")]
    channels = {a: grpc.aio.insecure_channel(a) for a in targets.values()}
    stubs = {a: rls_grpc.RateLimitServiceStub(ch) for a, ch in channels.items()}
    a, b = list(targets.values())
    kinds = [("local", a, pools[a]), ("forwarded", b, pools[a]),
             ("local", b, pools[b]), ("forwarded", a, pools[b])]  # fmt: skip
    lat: dict[str, list[float]] = {"local": [], "forwarded": []}
    try:
        # Until each replica holds a share of acme's rate (acme spans the
        # cells: docs/ha.md, "Tenants that span cells"), its owner answers
        # OVER_LIMIT with retry-after: one OK on every path first.
        for kind, where, pool in kinds:
            deadline = time.monotonic() + 60
            while True:
                rid = uuid.uuid4().hex
                resp = await stubs[where].ShouldRateLimit(ask(rid, pool), metadata=md, timeout=5)
                if resp.overall_code == OK:
                    await stubs[where].ShouldRateLimit(ask(rid, pool, True), metadata=md,
                                                       timeout=5)  # fmt: skip
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind} calls to {where} still refused after 60 s: {resp}")
                await asyncio.sleep(0.1)
        for i in range(n + 200):
            kind, where, pool = kinds[i % len(kinds)]
            rid = uuid.uuid4().hex
            t0 = time.perf_counter()
            resp = await stubs[where].ShouldRateLimit(ask(rid, pool), metadata=md, timeout=5)
            dt = (time.perf_counter() - t0) * 1000
            assert resp.overall_code == OK, resp
            await stubs[where].ShouldRateLimit(ask(rid, pool, True), metadata=md, timeout=5)
            if i >= 200:
                lat[kind].append(dt)
    finally:
        for ch in channels.values():
            await ch.close()
    return lat


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="timed calls (both kinds)")
    args = ap.parse_args()
    with database() as url, tempfile.TemporaryDirectory() as tmp:
        key = prepare(url)
        ports = {"r0": free_port(), "r1": free_port()}
        procs = [serve(url, m, p, Path(tmp) / m) for m, p in ports.items()]
        try:
            targets = {m: f"127.0.0.1:{p}" for m, p in ports.items()}
            got = owners(targets["r0"], key, len(targets))
            pools: dict[str, str] = {}
            for pool in POOLS:
                pools.setdefault(got[pool], pool)
            if len(pools) < 2:
                raise SystemExit(f"one replica owns every pool: {got}")
            lat = asyncio.run(run(targets, pools, key, args.requests))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
    print(f"ShouldRateLimit, request path, one at a time, {args.requests} timed calls "
          f"(two serve processes, PostgreSQL, auth on), ms:")  # fmt: skip
    print(f"{'':10} {'p50':>7} {'p90':>7} {'p99':>7} {'mean':>7}")
    for kind, values in lat.items():
        print(f"{kind:10} {pct(values, 50):7.3f} {pct(values, 90):7.3f} {pct(values, 99):7.3f} "
              f"{statistics.fmean(values):7.3f}")  # fmt: skip
    added = pct(lat["forwarded"], 50) - pct(lat["local"], 50)
    print(
        f"forwarding adds {added:.3f} ms at the median "
        f"(p99 {pct(lat['forwarded'], 99) - pct(lat['local'], 99):+.3f} ms)"
    )
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
