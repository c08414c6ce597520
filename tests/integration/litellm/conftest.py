"""A real LiteLLM proxy process with burstgate's callback, in front of the
fake engine, with the real control plane on PostgreSQL (one of each per
module: the proxy takes seconds to start).

The proxy is started as its users start it (``litellm --config``) with the
callback line of docs/litellm.md; LiteLLM keys have no database here, so a
``custom_auth`` module (a file next to the config, LiteLLM's documented
way) turns the bearer key into the key's team and metadata, which the
hook's rules read as they read a virtual key's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest

from controlplane.domain.policy import Policy
from controlplane.fakeengine import FakeEngine
from controlplane.fakeengine.app import EngineConfig
from controlplane.store.db import upgrade
from tests.conftest import LITELLM_OFFLINE_ENV, fresh_pg_database
from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import Plane, planes_on, tenant
from tests.support import free_port, wait_until

ENGINE_MODEL = "fake-llama"
MASTER_KEY = "sk-master-0123456789abcdef0123456789abcdef"

OFFLINE_ENV = LITELLM_OFFLINE_ENV  # tests/conftest.py

# bearer key -> (team_id, key metadata); sk-nobody has no team
AUTH_PY = '''
from litellm.proxy._types import UserAPIKeyAuth

KEYS = {
    "sk-acme": ("acme", {}),
    "sk-acme-premium": ("acme", {"burstgate_lane": "premium"}),
    "sk-tiny": ("tiny", {}),
    "sk-g": ("g", {}),
    "sk-d": ("d", {}),
    "sk-r": ("r", {}),
    "sk-nobody": (None, {}),
}


async def user_api_key_auth(request, api_key: str) -> UserAPIKeyAuth:
    team, metadata = KEYS[api_key]
    return UserAPIKeyAuth(api_key=api_key, team_id=team, metadata=metadata)
'''

# The snippet of docs/litellm.md, with the engine's model under three model groups:
# fake-busy is the pool a test reports as loaded, fake-small the fallback.
CONFIG_YAML = """
model_list:
{models}
litellm_settings:
  callbacks: ["burstgate_client.litellm.handler"]
general_settings:
  custom_auth: auth.user_api_key_auth
"""
MODEL = """  - model_name: {name}
    litellm_params:
      model: openai/{engine_model}
      api_base: http://127.0.0.1:{port}/v1
      api_key: none
"""
# The hook's own YAML (BURSTGATE_LITELLM_CONFIG); the control plane's
# address comes from the environment, as a deployment would set it.
HOOK_YAML = """
tenant_from: [team_id]
lane_from: [header.x-burstgate-lane, metadata.burstgate_lane]
pools: {fake-busy: busy}
settle_grace_s: 1
# The 429's x-ratelimit-* headers are best-effort within this bound (50 ms
# by default); the tests assert them, so a loaded CI machine gets time.
limits_timeout_s: 5
"""


class EngineThread:
    """The fake engine on an event loop of its own."""

    def __init__(self, speed: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = FakeEngine(cfg=EngineConfig(model=ENGINE_MODEL), speed=speed, port=0)
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result(timeout=30)

    @property
    def port(self) -> int:
        return self.engine.port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class LiteLLMProxy:
    """``litellm --config config.yaml`` in ``workdir``, until ``stop``;
    ``config`` is the file's text, or the path of a file used as it is."""

    def __init__(self, workdir: Path, config: str | Path, env: dict[str, str]) -> None:
        if isinstance(config, str):
            (workdir / "config.yaml").write_text(config)
            config = Path("config.yaml")
        self.port = free_port()
        self.log_path = workdir / "litellm.log"
        litellm = Path(sys.executable).with_name("litellm")
        with self.log_path.open("wb") as out:  # the child has its own copy of the fd
            self.p = subprocess.Popen(
                [str(litellm), "--config", str(config), "--host", "127.0.0.1",
                 "--port", str(self.port)],
                cwd=workdir, env={**os.environ, **OFFLINE_ENV, **env}, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until(self._ready, message=f"the LiteLLM proxy to start ({self.log_path})",
                   timeout=120)  # fmt: skip

    def _ready(self) -> bool:
        if self.p.poll() is not None:
            raise AssertionError(f"the LiteLLM proxy exited {self.p.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/health/liveliness", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def client(self, key: str = "sk-acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(timeout=10)


class Stack:
    def __init__(self, plane: Plane, engine: EngineThread, proxy: LiteLLMProxy) -> None:
        self.plane, self.engine, self.proxy = plane, engine, proxy

    def client(self, key: str = "sk-acme") -> openai.OpenAI:
        return self.proxy.client(key)

    def rows(self, *request_ids: str) -> dict[str, Any]:
        """The ledger's rows of these requests, once all are there."""
        ids = ", ".join(f"'{r}'" for r in request_ids)
        where = f"request_id IN ({ids})"
        wait_until(lambda: len(ledger_rows(self.plane.url, where)) >= len(request_ids) or None,
                   message=f"ledger rows of {request_ids}")  # fmt: skip
        time.sleep(0.2)  # and no more than one each
        got = ledger_rows(self.plane.url, where)
        assert len(got) == len(request_ids), got
        return {r.request_id: r for r in got}


@pytest.fixture(scope="module")
def stack(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("litellm")
    for url in fresh_pg_database(pg_admin_dsn):
        upgrade(url)
        for make in planes_on(url, work):
            plane = make(
                tenant("acme"),
                tenant("tiny", token_rate=Decimal(1), burst_tokens=400),
                tenant("g", max_concurrency=1, max_wait_ms=60_000, max_queued=100),
                tenant("d", fallback_model="fake-small"),
                # refused at once (no wait), refilled within the standard lane's SLO
                tenant("r", token_rate=Decimal(100), burst_tokens=400, max_wait_ms=0),
                policy=Policy(gate_fallback_inflight=100_000, degrade_max_tokens=8),
            )  # fmt: skip
            engine = EngineThread(speed=5.0)
            models = "".join(MODEL.format(name=n, engine_model=ENGINE_MODEL, port=engine.port)
                             for n in ("fake-llama", "fake-busy", "fake-small"))  # fmt: skip
            (work / "auth.py").write_text(AUTH_PY)
            (work / "hook.yaml").write_text(HOOK_YAML)
            env = {"LITELLM_MASTER_KEY": MASTER_KEY,
                   "BURSTGATE_LITELLM_CONFIG": str(work / "hook.yaml"),
                   "BURSTGATE_LITELLM_CONTROL_PLANE": plane.target}  # fmt: skip
            proxy = LiteLLMProxy(work, CONFIG_YAML.format(models=models), env)
            try:
                yield Stack(plane, engine, proxy)
            finally:
                proxy.stop()
                engine.stop()
