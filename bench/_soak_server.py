"""The soaked server: a real ``burstgate serve`` process, restarted on the
same gRPC port, metrics port and spool directory, and read from outside
(/proc for its memory, /metrics for its state) as an operator would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

READY = re.compile(r"burstgate listening on (\S+):(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rss_mib(pid: int) -> float | None:
    """VmRSS of ``pid`` in MiB; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(url: str, timeout: float = 2.0) -> dict[str, float] | None:
    """The /metrics samples without labels, and labelled ones as
    ``name{labels}``; None when the server does not answer."""
    try:
        body = urllib.request.urlopen(url, timeout=timeout).read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


@dataclass
class ServerProc:
    """``burstgate serve`` with ``env`` on ``port``; stdout and stderr go
    to ``log_dir/server-<n>.log`` (one file per start)."""

    env: dict[str, str]
    port: int
    metrics_port: int
    log_dir: Path
    starts: int = 0
    proc: subprocess.Popen[str] | None = None
    _log: IO[str] | None = None
    exit_codes: list[int] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, timeout: float = 90.0, attempts: int = 5) -> float:
        """Start and wait for the ready line; retried when the process exits
        before it is ready (a port still held by the previous process, a
        database briefly unreachable). Returns the seconds it took."""
        t0 = time.monotonic()
        for attempt in range(attempts):
            if self._start_once(timeout):
                return time.monotonic() - t0
            print(f"soak: server start {self.starts} failed (attempt {attempt + 1}), see "
                  f"{self.log_dir}", file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(2.0)
        raise RuntimeError(
            f"the server did not start in {attempts} attempts; logs in {self.log_dir}"
        )

    def _start_once(self, timeout: float) -> bool:
        self.starts += 1
        log = open(self.log_dir / f"server-{self.starts}.log", "w")  # noqa: SIM115 (kept open)
        env = {
            **os.environ,
            **self.env,
            "BURSTGATE_HOST": "127.0.0.1",
            "BURSTGATE_PORT": str(self.port),
            "BURSTGATE_METRICS_PORT": str(self.metrics_port),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )  # fmt: skip
        ready = threading.Event()

        def read() -> None:  # the ready line, then everything else to the log
            assert proc.stdout is not None
            for line in proc.stdout:
                if READY.search(line):
                    ready.set()
                log.write(line)
                log.flush()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                self.exit_codes.append(proc.wait())
                log.close()
                return False
        self.proc, self._log = proc, log
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit; SIGKILL after ``timeout``.
        Returns the exit code."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        self.exit_codes.append(code)
        if self._log is not None:
            self._log.close()
        self.proc = self._log = None
        return code

    def rss_mib(self) -> float | None:
        pid = self.pid
        return rss_mib(pid) if pid is not None else None

    def metrics(self) -> dict[str, float] | None:
        return scrape(self.metrics_url) if self.pid is not None else None
