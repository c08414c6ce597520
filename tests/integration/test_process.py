"""The real `burstgate` process: demo start-up, metrics, graceful SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from burstgate_client.protoclient import ProtoClient, pb
from prometheus_client.parser import text_string_to_metric_families

READY = re.compile(r"burstgate listening on (\S+):(\d+) \(fastpath=(\w+), metrics=(\S+)\)")


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "controlplane", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            cwd=cwd,
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.stderr.extend(self.p.stderr or []),
            daemon=True,
        )
        self._reader.start()
        assert self.p.stdout is not None
        for line in self.p.stdout:
            m = READY.search(line)
            if m:
                self.target = f"{m[1]}:{m[2]}"
                self.fastpath = m[3]
                self.metrics_url = m[4]
                return
        self.p.wait(timeout=30)
        raise AssertionError("server exited before it was ready:\n" + self.log())

    def log(self) -> str:
        """stderr so far; complete once the process has exited."""
        if self.p.poll() is not None:
            self._reader.join(timeout=30)
        return "".join(self.stderr)

    def close(self) -> None:
        for stream in (self.p.stdout, self.p.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def demo_proc(tmp_path: Path) -> Iterator[Proc]:
    proc = Proc(
        ["demo", "--port", "0"],
        {
            "BURSTGATE_DATABASE_URL": f"sqlite:///{tmp_path}/demo.db",
            "BURSTGATE_METRICS_PORT": "0",
            "BURSTGATE_LOG_FORMAT": "json",
        },
    )
    yield proc
    if proc.p.poll() is None:
        proc.p.kill()
    proc.p.wait(timeout=30)
    proc.close()


def test_demo_serves_the_demo_tenants_and_stops_gracefully_on_sigterm(demo_proc: Proc) -> None:
    expected = os.environ.get("BURSTGATE_FASTPATH", "cython")
    assert demo_proc.fastpath == ("python" if expected == "python" else "cython")
    with ProtoClient(demo_proc.target) as c:
        d = c.admit("acme", "r1", prompt_tokens=1200, max_tokens=400)
        assert d.decision == pb.DECISION_ADMIT and d.lane == "standard"
        free = c.admit("free-tier", "r1", prompt_tokens=500, max_tokens=4000)
        assert free.decision == pb.DECISION_ADMIT and free.granted_max_tokens == 2048
        assert free.lane == "batch"
        too_long = c.admit("free-tier", "r2", prompt_tokens=3000, max_tokens=10)
        assert too_long.reason == pb.REASON_MAX_TOKENS
        # the demo price list bills it: 1,200 input at 0.50 + 100 output at
        # 1.50 USD per million tokens
        s = c.complete("acme", "r1", prompt_tokens=1200, generated_tokens=100)
        assert (s.refunded_tokens, s.currency) == (300, "USD")
        assert s.user_charge == "0.000750000"
        assert (
            c.admit("nobody", "r1", prompt_tokens=1, max_tokens=1).reason
            == pb.REASON_UNKNOWN_TENANT
        )
    body = urllib.request.urlopen(demo_proc.metrics_url, timeout=10).read().decode()
    assert f'burstgate_fastpath_info{{implementation="{demo_proc.fastpath}"}} 1.0' in body
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }

    def sample(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    decided = "burstgate_decisions_total"
    assert sample(decided, tenant="acme", lane="standard", decision="admit", reason="ok") == 1
    unknown = {"tenant": "__unknown__", "lane": "standard", "reason": "unknown_tenant"}
    assert sample(decided, decision="reject", **unknown) == 1
    # the Complete above, billed 0.00075 USD, as the per-tenant spend counter
    charged = sample("burstgate_tenant_user_charge_total", tenant="acme", lane="standard",
                     currency="USD")  # fmt: skip
    assert charged == 0.00075
    demo_proc.p.send_signal(signal.SIGTERM)
    assert demo_proc.p.wait(timeout=60) == 0
    assert demo_proc.p.stdout is not None
    demo_proc.p.stdout.read()
    log = demo_proc.log()
    assert '"event": "stopped"' in log
    assert '"fastpath": "' + demo_proc.fastpath in log
