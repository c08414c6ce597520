"""Shared fixtures: databases (SQLite and a real PostgreSQL), fake clock,
and a real gRPC server on a free port."""

from __future__ import annotations

import asyncio
import io
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import psycopg
import pytest
import structlog
from sqlalchemy.engine import make_url

from controlplane.clock import Sleep
from controlplane.settings import Settings
from controlplane.store.db import upgrade
from tests.support import declaring_test_pools

# The variables that keep LiteLLM off the network (docs/litellm.md): the
# model cost map and the other tables it would fetch from GitHub at import,
# and Hugging Face tokenizers. Set for this process before any test module
# imports litellm (the callback's unit tests do), and passed to the LiteLLM
# proxy processes the integration tests start.
LITELLM_OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "HF_HUB_OFFLINE": "1",
    "NO_DOCKER_HEALTHCHECK": "1",
}
for _name, _value in LITELLM_OFFLINE_ENV.items():
    os.environ.setdefault(_name, _value)

# An existing DSN from the environment is honoured; the default is the local
# server these machines run (trust auth). Each test gets its own database.
PG_ADMIN_DSN = os.environ.get(
    "BURSTGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)

T = TypeVar("T")


class FakeClock:
    """Injected wall clock in nanoseconds; starts mid-hour on a fixed day."""

    def __init__(self, start_ns: int = 1_700_000_123_000_000_000) -> None:
        self.now_ns = start_ns
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self.now_ns

    def advance(self, ns: int) -> None:
        with self._lock:
            self.now_ns += ns


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def pg_admin_dsn() -> str:
    try:
        psycopg.connect(PG_ADMIN_DSN, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {PG_ADMIN_DSN} ({exc}). `make test` starts the "
            "local server; elsewhere set BURSTGATE_TEST_PG_DSN to an admin DSN."
        )
    return PG_ADMIN_DSN


@pytest.fixture
def pg_url(pg_admin_dsn: str) -> Iterator[str]:
    yield from fresh_pg_database(pg_admin_dsn)


def fresh_pg_database(pg_admin_dsn: str) -> Iterator[str]:
    """A fixture's body: a new, empty PostgreSQL database's URL, dropped
    after (also for fixtures of a wider scope than ``pg_url``'s)."""
    name = f"burstgate_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(pg_admin_dsn).set(database=name).render_as_string(hide_password=False)
    yield url
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/burstgate.db"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def migrated_url(db_url: str) -> str:
    upgrade(db_url)
    return db_url


class ServerThread:
    """A ControlPlane running on its own event loop in a background thread,
    bound to a free port. ``on_loop`` runs a function on the loop thread (the
    service is not thread-safe, exactly as in production)."""

    def __init__(
        self, settings: Settings, clock: Callable[[], int], sleep: Sleep | None = None
    ) -> None:
        from controlplane.server import ControlPlane

        # the pools the tests name are declared, unless the test lists its own
        # or runs several replicas (each declared pool is a cell renewed every
        # tick: the HA tests declare theirs)
        if settings.ha_member_id is None:
            settings = settings.model_copy(
                update={"policy": declaring_test_pools({"policy": settings.policy})["policy"]}
            )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.plane = self._run(self._make(ControlPlane, settings, clock, sleep or asyncio.sleep))
        self.port: int = self._run(self.plane.start())
        self.target = f"127.0.0.1:{self.port}"

    @staticmethod
    async def _make(cls: Any, settings: Settings, clock: Callable[[], int], sleep: Sleep) -> Any:
        return cls(settings, clock=clock, sleep=sleep)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def on_loop(self, fn: Callable[[], T]) -> T:
        fut: Future[T] = Future()

        def call() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return fut.result(timeout=30)

    def stop(self) -> None:
        if self.loop.is_closed():  # stopped already (a test restarting a server)
            return
        try:
            self._run(self.plane.stop(0))
        except TimeoutError:
            # A stop that hangs must not leave a server polling (and logging
            # into later tests' output): cancel everything on its loop, and
            # say where it hung.
            pending = [
                f"{t.get_name()}: {t.get_stack(limit=3)}" for t in asyncio.all_tasks(self.loop)
            ]
            for task in asyncio.all_tasks(self.loop):
                self.loop.call_soon_threadsafe(task.cancel)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            message = f"ControlPlane.stop did not end in 30 s; pending {pending}"
            raise AssertionError(message) from None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(
        database_url: str,
        clock: Callable[[], int] | None = None,
        sleep: Sleep | None = None,
        **overrides: Any,
    ) -> ServerThread:
        import time

        # Sidecar tokens are on by default for `serve`; tests of the admission
        # API run without them unless they ask (tests/integration/admin).
        overrides.setdefault("admission_auth", False)
        overrides.setdefault("metrics_port", -1)  # 0 = serve /metrics on a free port
        settings = Settings(database_url=database_url, host="127.0.0.1", port=0, **overrides)
        srv = ServerThread(settings, clock or time.time_ns, sleep)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def server_logs_elsewhere() -> Iterator[None]:
    """A server thread of the test's logs while CliRunner has swapped
    sys.stdout (structlog prints to stdout unless configured): its lines
    would land in the output of the command under test."""
    before = structlog.get_config()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=io.StringIO()))
    yield
    structlog.configure(**before)
