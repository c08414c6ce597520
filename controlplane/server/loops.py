"""The background loops that keep memory in step with the database: the
config poll (tenants, lanes, policy, API keys, signing keys, key last-use,
the Envoy mapping file, the replica lock), woken at once by a LISTEN
notification on PostgreSQL, and the reservation expiry. Nothing here runs
per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Engine

from controlplane.auth import KeyCache
from controlplane.clock import Sleep
from controlplane.domain.policy import effective_policy
from controlplane.ha.serving import Ownership
from controlplane.ledger.metering import Metering
from controlplane.server.keyuse import KeyUseWriter
from controlplane.server.threads import LoopCalls
from controlplane.service import AdmissionService
from controlplane.service.waiting import WaitingRoom
from controlplane.settings import Settings
from controlplane.store.config import ConfigRepository
from controlplane.store.notify import CONFIG_CHANNEL, LEASES_CHANNEL, Listener
from controlplane.store.replica_lock import ReplicaGuard
from controlplane.store.signing import signing_keys

if TYPE_CHECKING:
    from controlplane.integrations.envoy.config import LiveConfig

log = structlog.get_logger("burstgate.server")

# How often open reservations are checked against the TTL.
EXPIRY_INTERVAL_S = 0.5


def notify_listener(
    settings: Settings, on_config: Callable[[], None], on_lease: Callable[[str | None], None]
) -> Listener | None:
    """On PostgreSQL (unless ``listen_notify`` is off): a LISTEN
    connection (controlplane/store/notify.py). A config change wakes the
    config loop at once; a released cell wakes the HA coordinator, when
    this plane has one (controlplane/server/replicas.py)."""
    if not settings.listen_notify:
        return None
    listener = Listener(settings.database_url, name="burstgate serve notify")
    if not listener.enabled:  # SQLite: one replica, the poll is enough
        return None
    listener.on(CONFIG_CHANNEL, lambda payload: on_config())
    listener.on(LEASES_CHANNEL, on_lease)
    return listener


class ExpiryLoop:
    """Every ``EXPIRY_INTERVAL_S``: reservations past their TTL released."""

    def __init__(self, service: AdmissionService, waiting: WaitingRoom, sleep: Sleep) -> None:
        self.service, self.waiting, self._sleep = service, waiting, sleep

    async def run(self) -> None:
        while True:
            await self._sleep(EXPIRY_INTERVAL_S)
            self.once()

    def once(self) -> int:
        """One step of the expiry loop: release reservations past their TTL."""
        released = self.service.expire()
        self.waiting.reschedule()
        if released:
            log.info("reservations expired", released=released)
        return released


class ConfigLoop:
    """The config poll. ``envoy_config`` is set at start when the Envoy RLS
    is served (its mapping file is re-read on each poll)."""

    def __init__(
        self,
        settings: Settings,
        *,
        service: AdmissionService,
        waiting: WaitingRoom,
        ownership: Ownership,
        repo: ConfigRepository,
        engine: Engine,
        key_cache: KeyCache,
        replica: ReplicaGuard,
        metering: Metering | None,
        sleep: Sleep,
    ) -> None:
        self.settings = settings
        self.service, self.waiting, self.ownership = service, waiting, ownership
        self.repo, self.engine, self.key_cache = repo, engine, key_cache
        self.replica, self.metering, self._sleep = replica, metering, sleep
        self.calls = LoopCalls(settings.operator_db_timeout_s)  # its database work
        self.key_use = KeyUseWriter(key_cache, self.calls)
        self.envoy_config: LiveConfig | None = None
        self.wake = asyncio.Event()  # set by a config notification
        self.pools: set[str] = set()  # the declared pools of the config applied
        self._fingerprint: tuple[Any, ...] | None = None
        self._reload_lock = asyncio.Lock()  # admin writes and the poll reload in turn
        self._catalog_reloads: set[asyncio.Future[None]] = set()  # see reload_notified
        self.config_reloads = 0
        self.notified_reloads = 0  # reloads a notification triggered (notify.py)
        self.config_reload_failures = 0
        self.key_refresh_failures = 0

    async def load_config(self) -> bool:
        """Reload tenants and lanes when the database changed; True if applied."""
        async with self._reload_lock:
            return await self._load_config()

    async def _load_config(self) -> bool:
        repo = self.repo
        fp = await self.calls.run(repo.fingerprint)
        if fp == self._fingerprint:
            return False
        lanes, tenants, overrides = await self.calls.run(
            lambda: (repo.lanes(), repo.tenants(), repo.policy_overrides())
        )
        policy = effective_policy(self.settings.policy, overrides)
        # Applied on the event-loop thread: the fast path is not thread-safe
        # and every decision runs on this thread too.
        self.service.apply_config(tenants, lanes, policy)
        # The cells of the declared pools are coordinated from now.
        self.pools = set(self.service.views.declared_pools())
        self.ownership.add_pools(self.pools)
        self.waiting.reschedule()
        self._fingerprint = fp
        self.config_reloads += 1
        log.info("config loaded", tenants=len(tenants), lanes=[lane.name for lane in lanes])
        return True

    async def run(self, *, notified: bool) -> None:
        """The loop; ``notified``: a LISTEN connection sets ``wake``."""
        if not notified:
            while True:
                await self._sleep(self.settings.config_poll_s)
                await self.poll_once()
        # With LISTEN: a notification reloads at once, and the poll keeps its
        # own rhythm (its timer runs on through notified reloads). A burst
        # of notifications makes one reload, or two when some arrive while
        # it runs (it may have read before their commit); this one task
        # runs them all, so never two at once.
        poll: asyncio.Future[Any] | None = None
        try:
            while True:
                if poll is None:
                    poll = asyncio.ensure_future(self._sleep(self.settings.config_poll_s))
                woken = asyncio.ensure_future(self.wake.wait())
                try:
                    await asyncio.wait((poll, woken), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                if self.wake.is_set():
                    self.wake.clear()
                    await self.reload_notified()
                if poll.done():
                    poll = None
                    await self.poll_once()
        finally:
            if poll is not None:
                poll.cancel()

    async def reload_notified(self) -> None:
        """What a config notification triggers: config, keys and (with the
        ledger) the price catalog, each only if changed (fingerprints)."""
        self.notified_reloads += 1
        await self._reload_config_and_keys()
        if self.metering is not None:
            # Shielded and awaited (``catalog_reloads_done``) before the
            # ledger's engine is disposed: a cancelled reload's thread would
            # otherwise hand its connection back to a disposed pool.
            reload = asyncio.ensure_future(self._reload_catalog(self.metering))
            self._catalog_reloads.add(reload)
            reload.add_done_callback(self._catalog_reloads.discard)
            await asyncio.shield(reload)

    async def catalog_reloads_done(self) -> None:
        await asyncio.gather(*self._catalog_reloads, return_exceptions=True)

    @staticmethod
    async def _reload_catalog(metering: Metering) -> None:
        try:
            await metering.reload_catalog()
        except Exception as exc:  # database down: the metering poll tries again
            log.warning("price catalog reload failed; keeping the last one", error=str(exc))

    async def poll_once(self) -> None:
        """One step of the config poll: reload changed config, refresh the
        key cache, write the keys' last use. The steps are independent: a
        config that fails to load or apply must never keep a revoked key
        working, nor a key refresh that fails keep a config change from
        applying, nor a failed last-use write either of them."""
        await self._reload_config_and_keys()
        await self.key_use.save()
        if self.envoy_config is not None:
            self.envoy_config.poll()  # a changed mapping file (kept if bad)
        try:
            await self.replica.poll()  # lost and taken by another serve: health NOT_SERVING
        except Exception as exc:  # database down or slow: asked again at the next poll
            log.warning("replica lock check failed", error=str(exc))

    async def _reload_config_and_keys(self) -> None:
        try:
            await self.load_config()
        except Exception as exc:  # database down, or a config that cannot apply
            self.config_reload_failures += 1
            log.warning("config poll failed; serving last config", error=str(exc))
        started = time.monotonic()
        try:
            await self.calls.run(self.key_cache.refresh)
        except Exception as exc:  # database down: keep the keys as last read
            self.key_cache.note_refresh(False)  # unknown keys are refused at once meanwhile
            self.key_refresh_failures += 1
            log.warning("key refresh failed; serving last keys", error=str(exc))
        else:
            self.key_cache.note_refresh(True, time.monotonic() - started)
        if self.settings.admission_signing_key is None:  # a rotation reaches every replica
            try:
                await self.load_signing_keys()
            except Exception as exc:  # database down: sign with the keys as last read
                self.key_refresh_failures += 1
                log.warning("signing key refresh failed; keeping the last ones", error=str(exc))

    async def load_signing_keys(self) -> None:
        """The keys admissions are signed with (store/signing.py): read in a
        thread, installed on the loop (the service is the loop's alone)."""
        keys = await self.calls.run(lambda: signing_keys(self.settings, self.engine))
        self.service.signer.install(keys)
