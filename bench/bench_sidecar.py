"""The latency the HTTP sidecar adds (issue 15): the same requests sent
straight to a fake engine and through the sidecar in front of it, in the
same run, twice:

1. one at a time (closed loop, ``--sequential`` requests, alternating
   paths): what a request pays with no queueing anywhere;
2. open loop at ``--rate`` requests/s, alternating between the two paths
   every ``--slice`` seconds (so the engine sees the same rate throughout,
   and each path gets half of the measured time).

    .venv/bin/python bench/bench_sidecar.py [--rate 500] [--seconds 60] [--admitter sdk|stub]

Processes: the fake engine (``burstgate fake-engine --speed 1000``: the
modelled GPU time is microseconds, so what is measured is HTTP and the
proxy), the sidecar (``burstgate sidecar``), and with ``--admitter sdk``
(the default) a demo control plane (``burstgate demo`` on a temporary
SQLite database) that the sidecar admits and settles every request with;
``--admitter stub`` puts an in-process always-admit in the SDK's place, to
see the proxy's own share. The load generator is this process (uvloop,
aiohttp, keep-alive connections). Each request: a short chat prompt, 8
output tokens, not streamed (``--stream`` streams them). The first
``--warmup`` seconds are not counted. Added latency = through the sidecar
minus straight, per percentile. CPU per request = the sidecar process's
user + system time over the open-loop run divided by the requests it
served (its load reports included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
BG = [sys.executable, "-m", "controlplane"]
STUB_SIDECAR = """
import asyncio, sys, uvloop
sys.path.insert(0, {root!r})
from burstgate_client.sidecar import Sidecar, load
from tests.sidecar_support import FakeAdmitter

async def serve():
    cfg = load(upstream={upstream!r}, control_plane="127.0.0.1:1", port={port},
               default_tenant="acme")
    sidecar = Sidecar(cfg, FakeAdmitter())
    await sidecar.start()
    await asyncio.Event().wait()

uvloop.run(serve())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port}")


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p / 100))] if s else float("nan")


async def sequential(direct: str, sidecar: str, n: int, stream: bool) -> dict[str, list[float]]:
    """``n`` requests one at a time, alternating paths (after 200 to warm up)."""
    body: dict[str, Any] = {"model": "fake-llama", "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "user", "content": "a short prompt"}]}
    lat: dict[str, list[float]] = {"direct": [], "sidecar": []}
    async with aiohttp.ClientSession() as http:
        for i in range(n + 200):
            name, url = ("sidecar", sidecar) if i % 2 else ("direct", direct)
            t0 = time.perf_counter()
            async with http.post(url, json=body, headers={"authorization": "Bearer sk-bench"}) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 200:
                lat[name].append((time.perf_counter() - t0) * 1000)
    return lat


def table(lat: dict[str, list[float]], paths: tuple[str, str] = ("direct", "sidecar")) -> None:
    """The two paths side by side, and what the second adds (also used by
    bench_envoy.py and bench_litellm.py)."""
    print("| path | requests | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in paths:
        v = lat[name]
        print(f"| {name} | {len(v):,} | {pct(v, 50):.2f} | {pct(v, 90):.2f} | {pct(v, 99):.2f} "
              f"| {max(v, default=float('nan')):.2f} |")  # fmt: skip
    a, b = lat[paths[0]], lat[paths[1]]
    print(f"| **added** | | {pct(b, 50) - pct(a, 50):.2f} | {pct(b, 90) - pct(a, 90):.2f} | "
          f"{pct(b, 99) - pct(a, 99):.2f} | |")  # fmt: skip


async def send(
    direct: str, sidecar: str, *, rate: float, seconds: float, warmup: float, stream: bool,
    slice_s: float,
) -> tuple[dict[str, list[float]], int]:  # fmt: skip
    """Open loop at ``rate``, to one path then the other in slices of
    ``slice_s``; the latencies of each path (ms) and the errors."""
    body: dict[str, Any] = {"model": "fake-llama", "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "user", "content": "a short prompt"}]}
    headers = {"authorization": "Bearer sk-bench"}
    lat: dict[str, list[float]] = {"direct": [], "sidecar": []}
    errors = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def one(name: str, url: str, counted: bool) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                async with http.post(url, json=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if not ok:
                errors += 1
            elif counted:
                lat[name].append((time.perf_counter() - t0) * 1000)

        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        for i in range(int((seconds + warmup) * rate)):
            t = i / rate
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            name, url = ("sidecar", sidecar) if int(t / slice_s) % 2 else ("direct", direct)
            task = asyncio.create_task(one(name, url, t >= warmup))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return lat, errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500.0, help="requests/s")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--slice", type=float, default=1.0, help="s to one path, then the other")
    ap.add_argument("--admitter", choices=["sdk", "stub"], default="sdk")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--sequential", type=int, default=2000, help="closed-loop requests")
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory()
    try:
        ep, sp = free_port(), free_port()
        engine = spawn([*BG, "fake-engine", "--port", str(ep), "--speed", "1000"])
        procs.append(engine)
        wait_port(ep, engine, "fake engine")
        upstream = f"http://127.0.0.1:{ep}"
        if args.admitter == "stub":
            code = STUB_SIDECAR.format(root=str(ROOT), upstream=upstream, port=sp)
            sidecar = spawn([sys.executable, "-c", code])
        else:
            cp = free_port()
            db = f"sqlite:///{tmp.name}/bench.db"
            plane = spawn([*BG, "demo", "--port", str(cp), "--metrics-port", "-1",
                           "--database-url", db])  # fmt: skip
            procs.append(plane)
            wait_port(cp, plane, "control plane")
            cfg = Path(tmp.name) / "sidecar.yaml"
            cfg.write_text("api_keys: {sk-bench: acme}\n")
            sidecar = spawn([*BG, "sidecar", "--upstream", upstream, "--control-plane",
                             f"127.0.0.1:{cp}", "--port", str(sp), "--config", str(cfg)])
        procs.append(sidecar)
        wait_port(sp, sidecar, "sidecar")
        import uvloop

        direct, through = (f"{upstream}/v1/chat/completions",
                           f"http://127.0.0.1:{sp}/v1/chat/completions")  # fmt: skip
        one_by_one: dict[str, list[float]] = {"direct": [], "sidecar": []}
        if args.sequential:
            one_by_one = uvloop.run(sequential(direct, through, args.sequential, args.stream))
        cpu0 = cpu_s(sidecar.pid)
        lat, errors = uvloop.run(send(
            direct, through, rate=args.rate, seconds=args.seconds, warmup=args.warmup,
            stream=args.stream, slice_s=args.slice,
        ))  # fmt: skip
        cpu = cpu_s(sidecar.pid) - cpu0
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=60)
        tmp.cleanup()
    kind = "streamed" if args.stream else "not streamed"
    print(f"admitter {args.admitter}, {kind}, {os.cpu_count()} CPUs, load average at the end "
          f"{Path('/proc/loadavg').read_text().split()[0]}\n")
    if args.sequential:
        print(f"One at a time ({args.sequential:,} requests, alternating):\n")
        table(one_by_one)
    print(f"\nOpen loop, {args.rate:g} req/s, paths alternating every {args.slice:g} s, "
          f"{args.seconds:g} s measured (+{args.warmup:g} s warm-up), errors {errors}:\n")
    table(lat)
    served = len(lat["sidecar"]) + errors
    print(f"\nsidecar process CPU: {cpu:.1f} s, {cpu / max(1, served) * 1000:.2f} ms per request "
          f"it served ({served:,})")


if __name__ == "__main__":
    main()
