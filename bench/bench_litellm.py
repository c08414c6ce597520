"""The latency burstgate's LiteLLM callback adds (issue 17): two LiteLLM
proxies side by side in one run, the same config but for the callback
line, in front of the same fake engine; the requests alternate between
them, so both see the same machine at the same time.

1. one at a time (``--sequential`` requests, alternating);
2. ``--concurrency`` closed-loop clients for ``--seconds``, each
   alternating between the two proxies request by request.

    .venv/bin/python bench/bench_litellm.py [--sequential 400] [--concurrency 8] [--seconds 30]

Processes: the fake engine (``burstgate fake-engine --speed 1000``: model
time is microseconds, what is measured is HTTP and the gateway), a demo
control plane (``burstgate demo`` on a temporary SQLite database), and two
``litellm --config`` proxies (the master key; the callback's
``default_tenant: acme``), started offline (docs/litellm.md). Each request:
a short chat prompt, 8 output tokens, not streamed (``--stream``
streams). Added latency = with the callback minus without, per percentile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import bench_sidecar as sc

KEY = "sk-master-0123456789abcdef0123456789abcdef"
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
           "HF_HUB_OFFLINE": "1", "LITELLM_MASTER_KEY": KEY}  # fmt: skip
CONFIG = """
model_list:
  - model_name: fake-llama
    litellm_params: {{model: openai/fake-llama, api_base: "{engine}/v1", api_key: none}}
"""
CALLBACK = """
litellm_settings:
  callbacks: ["burstgate_client.litellm.handler"]
"""
PATHS = ("litellm", "litellm+burstgate")


def start_proxy(
    workdir: Path, config: str, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int]:
    workdir.mkdir()
    (workdir / "config.yaml").write_text(config)
    port = sc.free_port()
    litellm = Path(sys.executable).with_name("litellm")
    p = subprocess.Popen([str(litellm), "--config", "config.yaml", "--host", "127.0.0.1",
                          "--port", str(port)], cwd=workdir, env={**os.environ, **env},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return p, port


def wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a LiteLLM proxy exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/liveliness", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
    raise SystemExit(f"the LiteLLM proxy on {port} did not start")


Lat = dict[str, list[float]]


async def run(
    urls: dict[str, str], *, sequential: int, concurrency: int, seconds: float, stream: bool
) -> tuple[Lat, Lat, int]:
    body: dict[str, Any] = {"model": "fake-llama", "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "user", "content": "a short prompt"}]}
    headers = {"authorization": f"Bearer {KEY}"}
    errors = 0

    async def one(http: aiohttp.ClientSession, name: str, lat: dict[str, list[float]]) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        async with http.post(urls[name], json=body, headers=headers) as r:
            await r.read()
            if r.status != 200:
                errors += 1
                return
        lat[name].append((time.perf_counter() - t0) * 1000)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        warm: dict[str, list[float]] = {p: [] for p in PATHS}
        for i in range(100):  # warm-up: LiteLLM's first requests are slow
            await one(http, PATHS[i % 2], warm)
        async with http.post(urls[PATHS[1]], json=body, headers=headers) as r:
            await r.read()
            if "x-burstgate-pricing-multiplier" not in r.headers:  # admitted by burstgate
                raise SystemExit("the callback did not admit through burstgate")
        seq: dict[str, list[float]] = {p: [] for p in PATHS}
        for i in range(sequential):
            await one(http, PATHS[i % 2], seq)
        conc: dict[str, list[float]] = {p: [] for p in PATHS}
        end = time.perf_counter() + seconds

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < end:
                await one(http, PATHS[i % 2], conc)
                i += 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return seq, conc, errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequential", type=int, default=400, help="requests one at a time")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--seconds", type=float, default=30.0, help="of the concurrent phase")
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory()
    try:
        ep, cp = sc.free_port(), sc.free_port()
        engine = sc.spawn([*sc.BG, "fake-engine", "--port", str(ep), "--speed", "1000"])
        procs.append(engine)
        plane = sc.spawn([*sc.BG, "demo", "--port", str(cp), "--metrics-port", "-1",
                          "--database-url", f"sqlite:///{tmp.name}/bench.db"])  # fmt: skip
        procs.append(plane)
        sc.wait_port(ep, engine, "fake engine")
        sc.wait_port(cp, plane, "control plane")
        config = CONFIG.format(engine=f"http://127.0.0.1:{ep}")
        hook_env = {"BURSTGATE_LITELLM_CONTROL_PLANE": f"127.0.0.1:{cp}",
                    "BURSTGATE_LITELLM_DEFAULT_TENANT": "acme"}  # fmt: skip
        plain, pp = start_proxy(Path(tmp.name) / "plain", config, OFFLINE)
        procs.append(plain)
        hooked, hp = start_proxy(Path(tmp.name) / "hooked", config + CALLBACK,
                                 OFFLINE | hook_env)  # fmt: skip
        procs.append(hooked)
        wait_ready(pp, plain)
        wait_ready(hp, hooked)
        urls = {PATHS[0]: f"http://127.0.0.1:{pp}/v1/chat/completions",
                PATHS[1]: f"http://127.0.0.1:{hp}/v1/chat/completions"}  # fmt: skip
        import uvloop

        seq, conc, errors = uvloop.run(run(
            urls, sequential=args.sequential, concurrency=args.concurrency,
            seconds=args.seconds, stream=args.stream))  # fmt: skip
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=60)
        tmp.cleanup()
    kind = "streamed" if args.stream else "not streamed"
    print(f"{kind}, {os.cpu_count()} CPUs, load average at the end "
          f"{Path('/proc/loadavg').read_text().split()[0]}, errors {errors}\n")
    print(f"One at a time ({args.sequential:,} requests, alternating):\n")
    sc.table(seq, PATHS)
    print(f"\n{args.concurrency} concurrent clients, {args.seconds:g} s, alternating:\n")
    sc.table(conc, PATHS)


if __name__ == "__main__":
    main()
