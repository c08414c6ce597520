"""The latency burstgate adds as Envoy's rate-limit service (issue 17): the
same requests through one Envoy 1.40 process on two listeners, in the same
run, alternating one request to each:

- ``envoy``: deploy/envoy/envoy.yaml without its Lua and rate-limit filters
  (Envoy alone, straight to the engine);
- ``envoy+burstgate``: the file as shipped: a ShouldRateLimit call that
  reserves on the request path, the Lua filter reading the usage, and the
  stream-done call that settles it (after the response: not in the latency,
  but in the CPU).

    .venv/bin/python bench/bench_envoy.py [--requests 2000] [--stream]

Processes: the fake engine (``burstgate fake-engine --speed 1000``), a demo
control plane (``burstgate demo``, temporary SQLite, admission auth off)
serving the RLS with deploy/envoy/burstgate-envoy.yaml, and Envoy
(``--concurrency 1``). The client is this process (aiohttp, keep-alive),
one request at a time (nothing queues), after 200 to warm up. Added latency
= the second path minus the first, per percentile. CPU per request: the
control plane's user + system time over the run / the requests it decided.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from _summary import record
from bench_sidecar import cpu_s, free_port, pct, spawn, wait_port
from bench_sidecar import table as side_by_side

ROOT = Path(__file__).resolve().parents[1]
BG = [sys.executable, "-m", "controlplane"]
ENVOY = Path(sys.executable).with_name("envoy")
PATHS = ("envoy", "envoy+burstgate")


def envoy_config(alone: int, rls: int, admin: int, engine: int, plane: int) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin
    res = cfg["static_resources"]
    with_rls = res["listeners"][0]
    with_rls["address"]["socket_address"]["port_value"] = rls
    plain = copy.deepcopy(with_rls)
    plain["name"] = "alone"
    plain["address"]["socket_address"]["port_value"] = alone
    hcm = plain["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"].endswith(".router")]
    res["listeners"].append(plain)
    for cluster in res["clusters"]:
        port = engine if cluster["name"] == "engine" else plane
        ep = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ep["address"]["socket_address"]["port_value"] = port
    return cfg


async def sequential(
    urls: dict[str, str], n: int, stream: bool, refused: dict[str, int]
) -> dict[str, list[float]]:
    """Latencies of the 200s; anything else is counted in ``refused`` (a 429
    skips the engine: it would flatter the path) and not timed."""
    body: dict[str, Any] = {
        "model": "fake-llama", "max_tokens": 8, "stream": stream,
        "messages": [{"role": "user", "content": "a short prompt"}],
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    lat: dict[str, list[float]] = {p: [] for p in PATHS}
    async with aiohttp.ClientSession() as http:
        for i in range(n + 200):
            name = PATHS[i % 2]
            t0 = time.perf_counter()
            async with http.post(urls[name], json=body, headers={"x-tenant": "acme"}) as r:
                await r.read()
                if r.status != 200:
                    refused[name] = refused.get(name, 0) + 1
                    continue
            if i >= 200:
                lat[name].append((time.perf_counter() - t0) * 1000)
    return lat


def inflight(port: int) -> int:
    """acme's reservations still open (each stream-done call settles one)."""
    import grpc
    from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
    from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        limits = pb_grpc.AdmissionServiceStub(ch).GetLimits(
            pb.GetLimitsRequest(tenant_id="acme"), timeout=10
        )
    return int(limits.inflight_requests)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000, help="measured, both paths together")
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    procs = []
    tmp = tempfile.TemporaryDirectory()
    try:
        ep, cp, alone, rls, admin = (free_port() for _ in range(5))
        engine = spawn([*BG, "fake-engine", "--port", str(ep), "--speed", "1000"])
        procs.append(engine)
        wait_port(ep, engine, "fake engine")
        os.environ["BURSTGATE_ENVOY_RLS_CONFIG"] = str(ROOT / "deploy/envoy/burstgate-envoy.yaml")
        plane = spawn([*BG, "demo", "--port", str(cp), "--metrics-port", "-1",
                       "--database-url", f"sqlite:///{tmp.name}/bench.db"])  # fmt: skip
        procs.append(plane)
        wait_port(cp, plane, "control plane")
        path = Path(tmp.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(envoy_config(alone, rls, admin, ep, cp)))
        envoy = spawn([str(ENVOY), "-c", str(path), "--concurrency", "1", "-l", "error",
                       "--base-id", str(admin), "--disable-hot-restart"])  # fmt: skip
        procs.append(envoy)
        wait_port(rls, envoy, "envoy")
        import uvloop

        urls = {
            PATHS[0]: f"http://127.0.0.1:{alone}/v1/chat/completions",
            PATHS[1]: f"http://127.0.0.1:{rls}/v1/chat/completions",
        }
        cpu0 = cpu_s(plane.pid)
        refused: dict[str, int] = {}
        lat = uvloop.run(sequential(urls, args.requests, args.stream, refused))
        time.sleep(0.5)  # the last stream-done call
        cpu = cpu_s(plane.pid) - cpu0
        open_left = inflight(cp)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=60)
        tmp.cleanup()
    kind = "streamed" if args.stream else "not streamed"
    print(
        f"{kind}, {os.cpu_count()} CPUs, load average at the end "
        f"{Path('/proc/loadavg').read_text().split()[0]}\n"
    )
    print(
        f"One at a time ({args.requests:,} requests, alternating; not 200, not timed: "
        f"{refused or 'none'}):\n"
    )
    side_by_side(lat, PATHS)
    decided = len(lat[PATHS[1]]) + 100  # (the warm-up's half went through it too)
    alone_ms, through_ms = (lat[p] for p in PATHS)
    for q, bound in ((50, 1.0), (99, 2.0)):
        added = pct(through_ms, q) - pct(alone_ms, q)
        record(
            what=f"Envoy RLS, p{q} added per request ({kind}, one at a time)",
            ours=added, unit="ms", baseline=pct(alone_ms, q), baseline_name="Envoy alone, ms",
            ratio=pct(through_ms, q) / pct(alone_ms, q),
            target=f"keep (<= {bound:g} ms added)", met=added <= bound,
            bench=" ".join(["bench/bench_envoy.py", *sys.argv[1:]]),
        )  # fmt: skip
    record(
        what=f"Envoy RLS, control plane CPU per request ({kind})",
        ours=cpu / decided * 1000, unit="ms", target="reported", met=None,
        bench=" ".join(["bench/bench_envoy.py", *sys.argv[1:]]),
    )
    print(
        f"\ncontrol plane CPU: {cpu:.2f} s, {cpu / decided * 1000:.2f} ms per request "
        f"(two ShouldRateLimit calls each; {decided:,} requests); reservations left "
        f"open: {open_left}"
    )


if __name__ == "__main__":
    main()
