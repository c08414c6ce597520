"""What the fake engine says, and how it counts tokens.

- **Prompt tokens** are estimated as one token per 4 bytes of UTF-8 text
  (the usual rule of thumb for English and BPE tokenizers), at least 1; a
  client that knows the real count (a trace replay) sends it in the
  ``x-burstgate-prompt-tokens`` header.
- **Output**: exactly the number of tokens the request gets (see
  ``app.py``), each token one word from a fixed vocabulary with a leading
  space. The words are drawn from a generator seeded by the server's seed,
  the request's ``seed`` when it gives one, and the prompt text: the same
  request gets the same answer, whatever else the engine is doing.
- **Chat template**: a chat request's messages are rendered the way vLLM
  renders them through the model's chat template before it counts and
  caches the prompt: a fixed header first (``CHAT_HEADER``, modelled on
  Llama 3.1's, whose default system block carries its knowledge-cutoff
  date), then one ``role: content`` line per message, then the assistant's
  turn. The header is part of the prompt's tokens, as on vLLM, and it is
  what makes even one-line chats share their first cache blocks: without
  it a stream of short, different questions reads as a 100% miss rate,
  which no real chat engine reports (and which priced the demo at the
  miss-rate step).
- **Prefix cache**: the prompt text is cut into blocks of
  ``block_size`` tokens (4 bytes each); a block whose hash chain (its own
  text and every block before it) was seen before is a hit, as vLLM's
  automatic prefix caching counts them. Hits are reported (metrics and
  ``usage.prompt_tokens_details.cached_tokens``); the step time of the model
  does not shorten for them (see docs/loadtest.md).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

BYTES_PER_TOKEN = 4
WORDS = (
    "the", "a", "burst", "of", "tokens", "arrives", "and", "gate", "holds", "it", "while",
    "engine", "has", "room", "lane", "premium", "goes", "first", "batch", "waits", "queue",
    "drains", "in", "order", "tenant", "budget", "refills", "at", "rate", "model", "answers",
    "with", "words", "that", "mean", "nothing", "but", "count", "exactly", "as", "asked",
    "cache", "blocks", "fill", "step", "by", "latency", "stays", "low", "when", "load",
    "is", "shaped", "well", "so", "every", "request", "gets", "its", "turn", "fairly", "soon",
)  # fmt: skip


# 134 bytes (34 tokens at 4 bytes each), so two whole 16-token blocks (the
# default block size) are the same in every chat, as Llama 3.1's ~30 header
# tokens are on vLLM.
CHAT_HEADER = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
)
ASSISTANT_TURN = "assistant:"


def chat_prompt(lines: list[str]) -> str:
    """The prompt text of a chat request: the template's header, one line per
    message (``role: content``), then the assistant's turn."""
    return "\n".join([CHAT_HEADER, *lines, ASSISTANT_TURN])


def estimate_tokens(text: str) -> int:
    """Prompt tokens of ``text``: one per 4 UTF-8 bytes, at least 1."""
    return max(1, -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN))


def words(n: int, *, seed: int, request_seed: int | None, prompt: str) -> list[str]:
    """``n`` output tokens, each a word with a leading space."""
    digest = hashlib.blake2b(f"{seed}\0{request_seed}\0{prompt}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    return [" " + rng.choice(WORDS) for _ in range(n)]


class PrefixCache:
    """Hashes of prompt blocks seen, least recently used first out, at most
    ``capacity_blocks`` (the engine's KV blocks)."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        self.block_bytes = block_tokens * BYTES_PER_TOKEN
        self.block_tokens = block_tokens
        self.capacity = capacity_blocks
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, prompt: str, prompt_tokens: int) -> int:
        """Prompt tokens found cached (whole blocks, from the start), then
        remember every full block of this prompt."""
        data = prompt.encode("utf-8")
        chain = hashlib.blake2b(digest_size=16)
        hits, hitting = 0, True
        for start in range(0, len(data) - self.block_bytes + 1, self.block_bytes):
            chain.update(data[start : start + self.block_bytes])
            key = chain.digest()
            if hitting and key in self._seen:
                hits += self.block_tokens
                self._seen.move_to_end(key)
            else:
                hitting = False
                self._seen[key] = None
                if len(self._seen) > self.capacity:
                    self._seen.popitem(last=False)
        return min(hits, prompt_tokens)
