"""Issue 30 item 6: the demo's price moves only when a burst moves it.

The official openai client -> the sidecar -> the fake engine, with a real
control plane on PostgreSQL measuring the pool's KV-cache miss rate from the
sidecar's load reports (the engine's prefix-cache counters) in 1 s pricing
windows. Short, different chats (the demo traffic of docs/sidecar.md) used to read as a
100% miss rate and priced every window after the first at the 1.2 step; with
the engine's chat template they share its header blocks, as on vLLM, and the
price stays at the base. A stream of long, never-seen prompts is what makes
the miss rate, and then the price, rise.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.integration.sidecar.conftest import MODEL, Stack

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
MULTIPLIER = "x-burstgate-pricing-multiplier"
WINDOW_S = 1


SYSTEM = ("You are the support assistant of a small bakery. Answer in two sentences, "
          "politely, and only about opening hours, orders and deliveries.")  # fmt: skip


def ask(stack: Stack, content: str, max_tokens: int = 2, system: str = "") -> str:
    messages: list[Any] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    raw = stack.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens
    )
    raw.parse()
    return str(raw.headers[MULTIPLIER])


def next_window() -> None:
    """Sleep into the start of the next pricing window."""
    time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)


def test_short_chats_keep_the_base_price_and_a_burst_of_new_prompts_raises_it(
    pg_plane: Any, make_stack: Any
) -> None:
    plane = pg_plane(pricing_window_s=WINDOW_S)
    stack = make_stack(plane, speed=50.0)
    # The engine starts cold: its first chat misses every block. Its window
    # is left behind before anything is measured.
    ask(stack, "Hello!")
    time.sleep(0.5)  # its load report (a scrape every 0.1 s) is in by now,
    next_window()  # so this window measures nothing,
    next_window()  # and the first steady window is priced on it
    steady: list[str] = []
    deadline = time.monotonic() + 4 * WINDOW_S
    i = 0
    while time.monotonic() < deadline:  # about ten different chats a second
        # The one-line questions of docs/sidecar.md (docs/sidecar_burst.py's), and an
        # application's: its system prompt, then the user's question.
        if i % 2:
            steady.append(ask(stack, f"Question {i}"))
        else:
            steady.append(ask(stack, f"Do you deliver on day {i}?", system=SYSTEM))
        i += 1
        time.sleep(0.1)
    assert len(steady) >= 20
    assert set(steady) == {"1.000000"}, steady

    rng = random.Random(30)

    def novel(_: int) -> str:  # ~1,500 tokens no engine has seen
        words = " ".join(f"w{rng.getrandbits(40):x}" for _ in range(500))
        return ask(stack, words, max_tokens=1)

    seen: list[str] = []
    deadline = time.monotonic() + 4 * WINDOW_S
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline and "1.200000" not in seen:
            seen.extend(pool.map(novel, range(4)))
    assert "1.200000" in seen, seen  # the window after the burst's is priced at the step
