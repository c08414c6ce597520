"""Key last-use persistence: the API keys used since the last config poll,
written as last used at that poll (one UPDATE per poll, none per call)."""

from __future__ import annotations

import structlog

from controlplane.auth import KeyCache
from controlplane.server.threads import LoopCalls

log = structlog.get_logger("burstgate.server")


class KeyUseWriter:
    """Written by the config poll; what a failed write held is kept for the next."""

    def __init__(self, key_cache: KeyCache, calls: LoopCalls) -> None:
        self.key_cache = key_cache
        self.calls = calls
        self.failures = 0

    async def save(self) -> None:
        used = self.key_cache.take_used()
        if not used:
            return
        try:
            await self.calls.run(lambda: self.key_cache.save_used(used))
        except Exception as exc:  # database down: try again at the next poll
            self.key_cache.give_back(used)
            self.failures += 1
            log.warning("key last-use write failed; kept for the next poll", error=str(exc))
