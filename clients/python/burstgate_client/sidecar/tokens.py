"""Prompt token counts before forwarding, and output counts of a cut stream.

With a tokenizer (``tokenizer: path/to/tokenizer.json``, the Hugging Face
``tokenizers`` package: ``pip install 'burstgate-client[tokenizer]'``) the text is
encoded; without one, the estimate is one token per 4 UTF-8 bytes (the usual
rule of thumb for English and BPE vocabularies, the fake engine's own count).
Chat messages add ``MESSAGE_OVERHEAD`` tokens each for the role and the
template's markers, plus ``REPLY_PRIMING`` for the assistant's turn (as
OpenAI counts them). Either way it is an estimate: the admission reserves it,
and the settlement uses the engine's reported usage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from burstgate_client.errors import InvalidArgument

BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD = 4
REPLY_PRIMING = 3


def estimate(text: str) -> int:
    """One token per 4 UTF-8 bytes, rounded up (0 for no text)."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def load_tokenizer(path: Path) -> Callable[[str], int]:
    """A counter from a ``tokenizer.json``; InvalidArgument naming
    ``tokenizer`` when the package or the file is missing or bad."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InvalidArgument(
            "tokenizer", "needs the tokenizers package: pip install 'burstgate-client[tokenizer]'"
        ) from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception
        raise InvalidArgument("tokenizer", f"cannot load {path}: {exc}") from None

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids) if text else 0

    return count


@dataclass(frozen=True, slots=True)
class TokenCounter:
    count: Callable[[str], int] = estimate

    def prompt_tokens(self, body: dict[str, Any], chat: bool) -> int:
        """The prompt's tokens; at least 1 (an empty prompt still costs a step)."""
        if chat:
            total = REPLY_PRIMING
            for message in body.get("messages") or ():
                total += MESSAGE_OVERHEAD
                if isinstance(message, dict):
                    total += self._message(message)
            return max(1, total)
        return max(1, self._prompt(body.get("prompt")))

    def _message(self, message: dict[str, Any]) -> int:
        content = message.get("content")
        n = 0
        if isinstance(content, str):
            n += self.count(content)
        elif isinstance(content, list):  # content parts: text counts; images are not estimated
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    n += self.count(part["text"])
        if message.get("tool_calls"):  # the arguments the model wrote are prompt now
            n += self.count(json.dumps(message["tool_calls"]))
        if isinstance(message.get("name"), str):
            n += self.count(message["name"])
        return n

    def _prompt(self, prompt: Any) -> int:
        if isinstance(prompt, str):
            return self.count(prompt)
        if isinstance(prompt, list):
            if all(isinstance(p, int) for p in prompt):  # token ids
                return len(prompt)
            return sum(self._prompt(p) for p in prompt)  # a batch of prompts
        return 0


def prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a /v1/completions body carries (a list of strings or
    of token-id lists is a batch; each gets its own choices)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1
