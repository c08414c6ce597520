"""Issue 37: the engine's real prefix-cache reuse reaches the control plane
and moves the price, and the plane's eviction advice comes back on the
sidecar's answers.

The official openai client -> the sidecar -> the fake engine (vLLM's
``vllm:prefix_cache_*_total`` counters over its own prefix cache), with a
real control plane on PostgreSQL in 1 s pricing windows. One long prompt
asked again and again is served from the cache: the pool's miss rate on the
plane's /metrics is low and the price stays at the base; prompts the engine
has never seen miss: the plane reads a high miss rate, and the windows after
are priced at the step (miss rate > 0.30: x1.2).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.metrics.test_tenant_metrics import Samples, scrape_until
from tests.integration.sidecar.conftest import MODEL, Stack

pytestmark = [pytest.mark.postgres]
POOL = (("pool", "default"),)  # the sidecar's (and the demo's) pool
MISS = "burstgate_pool_kv_cache_miss_rate"
EVICT = "burstgate_pool_evict_below_reuse_per_second"
PRICE = "burstgate_pool_pricing_multiplier"
LONG = " ".join(f"clause {i} of the long shared system prompt." for i in range(150))  # ~1.6k tok


class Traffic:
    """Chats sent one after another on a thread until ``stop``; the last
    admitted answer's headers are kept."""

    def __init__(self, stack: Stack, messages: Callable[[], list[Any]]) -> None:
        self.stack, self.messages = stack, messages
        self.headers: dict[str, str] = {}
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = self.stack.client()
        while not self._stop.is_set():
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=1, messages=self.messages()
            )
            raw.parse()
            self.headers = dict(raw.headers)
            self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def of(m: Samples, name: str) -> float | None:
    return m.get((name, POOL))


def test_the_engines_miss_rate_reaches_the_plane_and_moves_the_multiplier(
    pg_plane: Any, make_stack: Any
) -> None:
    plane = pg_plane(pricing_window_s=1, metrics_port=0, metrics_sample_s=0.05)
    stack = make_stack(plane, speed=50.0)
    srv = plane.srv

    # Reuse: the same long prompt each time (after the first, all but its
    # last partial block is cached)
    warm = Traffic(stack, lambda: [{"role": "system", "content": LONG},
                                   {"role": "user", "content": "When do you open?"}])  # fmt: skip
    try:
        m = scrape_until(srv, lambda m: (r := of(m, MISS)) is not None and r < 0.1,
                         "a low miss rate from the engine's counters")  # fmt: skip
        # the first chat missed (a cold engine) and priced the window after
        # it at the step; two windows later, priced on reuse alone, the base
        time.sleep(2.2)
        m = scrape_until(srv, lambda m: of(m, PRICE) is not None, "the price")
        assert of(m, PRICE) == 1.0
    finally:
        warm.stop()
    # the engine's own count agrees with what reached the plane
    engine = stack.engine_metrics()
    hits = engine["vllm:prefix_cache_hits_total"]
    assert hits / engine["vllm:prefix_cache_queries_total"] > 0.8
    # the advice on the answer is the plane's for the pool (nothing queued: its top step)
    assert warm.headers["x-burstgate-evict-below-reuse-per-s"] == "0.3"
    assert of(m, EVICT) == 0.3

    # No reuse: long prompts the engine has never seen (only the chat
    # template's header blocks are shared)
    rng = random.Random(37)
    cold = Traffic(stack, lambda: [{"role": "user", "content": " ".join(
        f"w{rng.getrandbits(40):x}" for _ in range(400))}])  # fmt: skip
    try:
        scrape_until(srv, lambda m: (r := of(m, MISS)) is not None and r > 0.5,
                     "a high miss rate from the engine's counters")  # fmt: skip
        # the window that measured it prices the next one at the step
        scrape_until(srv, lambda m: of(m, PRICE) == 1.2, "the multiplier at the 0.30 step")
    finally:
        cold.stop()
    # a cold engine's pool is not busier: the same advice still comes back
    assert cold.headers["x-burstgate-evict-below-reuse-per-s"] == "0.3"
