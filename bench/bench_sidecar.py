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
served (its load reports included); the fake engine's CPU per request over
the same run is printed beside it as the no-sidecar baseline.

``--profile PATH`` runs the sidecar under cProfile (PATH gets its stats
when it exits) and prints its costliest functions per request: where the
sidecar's CPU goes under this load.

The targets-table rows (bench/_summary.py): the sidecar's CPU per request,
and the p50 and p99 it adds in the open loop, each beside the engine-alone
figure of the same run.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _summary import record

ROOT = Path(__file__).resolve().parents[1]
BG = [sys.executable, "-m", "controlplane"]
STUB_SIDECAR = """
import asyncio, signal, sys, uvloop
sys.path.insert(0, {root!r})
from burstgate_client.sidecar import Sidecar, load
from tests.sidecar_support import FakeAdmitter

async def serve():
    cfg = load(upstream={upstream!r}, control_plane="127.0.0.1:1", port={port},
               default_tenant="acme")
    sidecar = Sidecar(cfg, FakeAdmitter())
    await sidecar.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()  # then exits normally: a profile (--profile) is written
    await sidecar.stop()

uvloop.run(serve())
"""


# The sidecar under cProfile with a CPU-time clock: wall time would charge a
# socket write with the time the kernel gave the other processes meanwhile.
PROFILED = """
import cProfile, runpy, sys, time
path, target = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
prof = cProfile.Profile(time.process_time)
prof.enable()
try:
    if target == "-m":
        sys.argv = sys.argv[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(path)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(cmd: list[str], client_path: str = "") -> subprocess.Popen[bytes]:
    """``client_path``: a directory whose burstgate_client the process
    imports instead of the installed one (another tree's sidecar)."""
    env = None
    if client_path:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (client_path, os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env=env)  # fmt: skip


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
) -> tuple[dict[str, list[float]], int, int]:  # fmt: skip
    """Open loop at ``rate``, to one path then the other in slices of
    ``slice_s``; the latencies of each path (ms), the errors, and how many
    requests went to the sidecar (its warm-up's too)."""
    body: dict[str, Any] = {"model": "fake-llama", "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "user", "content": "a short prompt"}]}
    headers = {"authorization": "Bearer sk-bench"}
    lat: dict[str, list[float]] = {"direct": [], "sidecar": []}
    errors = 0
    handled = {"direct": 0, "sidecar": 0}  # warm-up included
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
            handled[name] += 1
            task = asyncio.create_task(one(name, url, t >= warmup))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return lat, errors, handled["sidecar"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500.0, help="requests/s")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--slice", type=float, default=1.0, help="s to one path, then the other")
    ap.add_argument("--admitter", choices=["sdk", "stub"], default="sdk")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--sequential", type=int, default=2000, help="closed-loop requests")
    ap.add_argument("--profile", type=Path, help="cProfile the sidecar, stats to this file")
    ap.add_argument("--client-path", default="", help="run the burstgate_client found here "
                    "(e.g. another commit's clients/python, from git archive)")  # fmt: skip
    args = ap.parse_args()
    profile = ["-c", PROFILED, str(args.profile.resolve())] if args.profile else []
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
            script = Path(tmp.name) / "stub_sidecar.py"
            script.write_text(code)
            sidecar = spawn([sys.executable, *profile, str(script)], args.client_path)
        else:
            cp = free_port()
            db = f"sqlite:///{tmp.name}/bench.db"
            plane = spawn([*BG, "demo", "--port", str(cp), "--metrics-port", "-1",
                           "--database-url", db])  # fmt: skip
            procs.append(plane)
            wait_port(cp, plane, "control plane")
            cfg = Path(tmp.name) / "sidecar.yaml"
            cfg.write_text("api_keys: {sk-bench: acme}\n")
            sidecar = spawn([sys.executable, *profile, "-m", "controlplane", "sidecar",
                             "--upstream", upstream, "--control-plane", f"127.0.0.1:{cp}",
                             "--port", str(sp), "--config", str(cfg),
                             "--spool", str(Path(tmp.name) / "spool.jsonl")],
                            args.client_path)  # fmt: skip
        procs.append(sidecar)
        wait_port(sp, sidecar, "sidecar")
        import uvloop

        direct, through = (f"{upstream}/v1/chat/completions",
                           f"http://127.0.0.1:{sp}/v1/chat/completions")  # fmt: skip
        one_by_one: dict[str, list[float]] = {"direct": [], "sidecar": []}
        seq0, seq_engine0 = cpu_s(sidecar.pid), cpu_s(engine.pid)
        if args.sequential:
            one_by_one = uvloop.run(sequential(direct, through, args.sequential, args.stream))
        seq_cpu = cpu_s(sidecar.pid) - seq0
        seq_engine = cpu_s(engine.pid) - seq_engine0
        cpu0, engine0 = cpu_s(sidecar.pid), cpu_s(engine.pid)
        lat, errors, open_loop = uvloop.run(send(
            direct, through, rate=args.rate, seconds=args.seconds, warmup=args.warmup,
            stream=args.stream, slice_s=args.slice,
        ))  # fmt: skip
        cpu, engine_cpu = cpu_s(sidecar.pid) - cpu0, cpu_s(engine.pid) - engine0
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
        half = (args.sequential + 200) // 2  # each path's share, its warm-up included
        print(f"\nsidecar process CPU one at a time: {seq_cpu / half * 1000:.2f} ms per request; "
              f"fake engine: {seq_engine / (2 * half) * 1000:.2f} ms per request")  # fmt: skip
    print(f"\nOpen loop, {args.rate:g} req/s, paths alternating every {args.slice:g} s, "
          f"{args.seconds:g} s measured (+{args.warmup:g} s warm-up), errors {errors}:\n")
    table(lat)
    served = len(lat["sidecar"]) + errors
    sent = int((args.seconds + args.warmup) * args.rate)
    per_request = cpu / max(1, served) * 1000
    engine_per_request = engine_cpu / max(1, sent) * 1000
    print(f"\nsidecar process CPU: {cpu:.1f} s, {per_request:.2f} ms per request "
          f"it served ({served:,})")
    print(f"fake engine CPU: {engine_cpu:.1f} s, {engine_per_request:.2f} ms per request "
          f"(both paths, {sent:,})")
    if args.profile:  # over every request the sidecar handled (its warm-ups too)
        warm = (args.sequential + 200) // 2 if args.sequential else 0
        print_profile(args.profile, open_loop + warm)
    summarise(args, lat, per_request, engine_per_request, errors)


def print_profile(path: Path, handled: int, top: int = 30) -> None:
    """The sidecar's costliest functions (own CPU time), per request it handled."""
    import pstats

    if not path.exists():
        print(f"\nno profile at {path} (the sidecar did not exit cleanly)")
        return
    stats = pstats.Stats(str(path))
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    print(f"\nsidecar profile ({path}), CPU per request handled ({handled:,}), top {top}:\n")
    print("| function | calls per request | own µs per request | cumulative µs per request |")
    print("|---|---:|---:|---:|")
    n = max(1, handled)
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        print(f"| `{where}` | {calls / n:.2f} | {own / n * 1e6:.1f} | {cum / n * 1e6:.1f} |")


def summarise(
    args: argparse.Namespace, lat: dict[str, list[float]], per_request: float,
    engine_per_request: float, errors: int,
) -> None:  # fmt: skip
    """The targets-table rows, each with the engine-alone figure of this run.
    A run with failed requests meets no target: the machine did not sustain
    the rate, and a saturated direct path can make the added figures
    negative."""
    kind = "streamed" if args.stream else "not streamed"
    bench = (f"bench/bench_sidecar.py --admitter {args.admitter} --rate {args.rate:g} "
             f"--seconds {args.seconds:g}" + (" --stream" if args.stream else ""))  # fmt: skip
    note = (f"admitter {args.admitter}, load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs, {errors} failed requests")  # fmt: skip
    clean = errors == 0
    record(what="HTTP sidecar, CPU per request", ours=per_request, unit="ms CPU/request",
           baseline=engine_per_request, baseline_name="the fake engine's CPU per request",
           target="≤ 0.5 ms", met=clean and per_request <= 0.5, note=note, bench=bench)  # fmt: skip
    direct, through = lat["direct"], lat["sidecar"]
    for p, limit in ((50, 1.0), (99, 2.0)):
        added = pct(through, p) - pct(direct, p)
        record(what=f"HTTP sidecar, added p{p} at {args.rate:,.0f} req/s {kind}", ours=added,
               unit="ms added", baseline=pct(direct, p), baseline_name=f"engine alone p{p} ms",
               target=f"≤ {limit:g} ms", met=clean and added <= limit, note=note,
               bench=bench)  # fmt: skip


if __name__ == "__main__":
    main()
