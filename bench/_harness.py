"""What bench_grpc.py and bench_shaping.py share: the server process's command
loop, the spawned processes and their pipes, waiting for a quiet machine, and
the report's common lines.

A benchmark spawns its server(s) and load processes (``spawn``), talks to each
over a pipe, one request and one answer at a time (``Child``), and stops them
with ``stop``. A server process runs ``serve_commands`` on its event loop:
``stop``, ``profile_on`` and ``profile_off`` are built in, everything else is a
handler the benchmark passes (``stats``, ...), run on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import inspect
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import _loadgen as lg

REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------ server process


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_server(serve: Coroutine[Any, Any, None]) -> None:
    """Body of a server process's entry point: quiet logs, stdout to stderr
    (stdout belongs to the report), ``serve`` on uvloop."""
    os.dup2(2, 1)
    from controlplane.telemetry import logs

    logs.configure("console", "warning")
    import uvloop

    uvloop.run(serve)


async def serve_commands(conn: Connection, handlers: Mapping[str, Callable[..., Any]]) -> None:
    """Answer the commands (tuples) the benchmark sends until ``("stop",)``
    or a closed pipe. ``handlers[cmd[0]](*cmd[1:])`` answers the others
    (awaited if it returns an awaitable); ``profile_on`` / ``profile_off
    <path>`` run cProfile on the event-loop thread, where every RPC runs."""
    profiler: cProfile.Profile | None = None
    while True:
        try:
            cmd = await asyncio.to_thread(conn.recv)
        except EOFError:
            break
        if cmd[0] == "stop":
            break
        if cmd[0] == "profile_on":
            profiler = cProfile.Profile()
            profiler.enable()
            conn.send("ok")
        elif cmd[0] == "profile_off":
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(cmd[1])
            profiler = None
            conn.send("ok")
        elif cmd[0] in handlers:
            answer = handlers[cmd[0]](*cmd[1:])
            if inspect.isawaitable(answer):
                answer = await answer
            conn.send(answer)
        else:
            conn.send(f"unknown command {cmd!r}")


# ------------------------------------------------------- spawned processes


@dataclass
class Child:
    """A spawned process answering one message at a time over its pipe."""

    name: str
    proc: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def run(self, msg: Any, timeout: float) -> Any:
        """Send ``msg``, return the answer; an exception answered is raised."""
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            what = msg[0] if isinstance(msg, tuple) else type(msg).__name__
            raise TimeoutError(f"{self.name} did not answer {what!r} in {timeout:.0f} s")
        result = self.conn.recv()
        if isinstance(result, BaseException):
            raise result
        return result

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        """A server command: ``call("stats", "full")``."""
        return self.run(cmd, timeout)

    def stop(self, msg: Any) -> None:
        """Ask the process to end with ``msg``; terminate it if it does not."""
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(msg)
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def spawn(ctx: Any, name: str, target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    """Start ``target(conn, *args)`` in a daemon process; return it and our
    end of the pipe."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()
    return proc, parent


# ------------------------------------------------------------ measurement


def quiesce(
    pids: Sequence[int], max_wait_s: float = 4.0, window_s: float = 0.25, machine_cores: float = 0.5
) -> bool:
    """Wait (bounded) until every process in ``pids`` uses < ~10% of a core
    and the whole machine < ``machine_cores``; False if it never got there."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = [lg.proc_cpu_s(p) for p in pids]
        busy0 = lg.machine_busy_s()
        time.sleep(window_s)
        after = [lg.proc_cpu_s(p) for p in pids]
        busy = (lg.machine_busy_s() - busy0) / window_s
        idle = all((a - b) / window_s < 0.1 for a, b in zip(after, before, strict=True))
        if idle and busy < machine_cores:
            return True
        if time.monotonic() >= deadline:
            return False


# ----------------------------------------------------------------- report


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def unary_medians(rs: Sequence[lg.UnaryResult]) -> dict[str, float]:
    """Medians across rounds of the unary load figures both reports show."""
    return {
        "done": median([r.completed_per_s for r in rs]),
        "p50": median([r.p50_ms for r in rs]),
        "p99": median([r.p99_ms for r in rs]),
        "max": median([r.max_ms for r in rs]),
        "cpu": median([r.server_cpu_s / r.calls * 1e6 for r in rs if r.calls]),
        "lag": median([r.send_lag_p99_ms for r in rs]),
        "err": float(sum(r.errors for r in rs)),
        "adm": median([r.admitted_fraction * 100 for r in rs]),
        "oth": median([r.other_cores for r in rs]),
        "stl": median([r.steal_fraction * 100 for r in rs]),
    }


def clean_paths(text: str) -> str:
    """Profile text with the checkout and the venv prefix taken off paths."""
    text = text.replace(str(REPO_ROOT) + "/", "")
    return text.replace(str(Path(sys.prefix)) + "/", "")


def command_line(script: str, argv: Sequence[str] | None) -> list[str]:
    """How the benchmark was run, for the report."""
    return [
        os.path.relpath(sys.executable),
        os.path.relpath(script),
        *(sys.argv[1:] if argv is None else argv),
    ]


def machine() -> list[str]:
    """The report's lines about the machine and the library versions."""
    from importlib.metadata import version

    import google.protobuf
    import grpc
    from google.protobuf.internal import api_implementation

    import fastpath

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return [
        f"- CPU: {os.cpu_count()} logical cores (nproc), affinity "
        f"{len(os.sched_getaffinity(0))}, {model or 'unknown model'}",
        f"- Python {platform.python_version()} ({platform.python_implementation()}), "
        f"grpcio {grpc.__version__}, protobuf {google.protobuf.__version__} "
        f"({api_implementation.Type()} backend), uvloop {version('uvloop')}, "
        f"numpy {version('numpy')}",
        f"- fastpath implementation: `{fastpath.IMPLEMENTATION}` (bench process)",
    ]
