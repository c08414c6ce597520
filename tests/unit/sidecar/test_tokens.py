"""Prompt token counts: the documented estimate, and a real tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from burstgate_client.errors import InvalidArgument
from burstgate_client.sidecar.tokens import (
    MESSAGE_OVERHEAD,
    REPLY_PRIMING,
    TokenCounter,
    estimate,
    load_tokenizer,
    prompt_count,
)


def test_the_estimate_is_a_token_per_four_bytes() -> None:
    assert estimate("") == 0 and estimate("abcd") == 1 and estimate("abcde") == 2
    assert estimate("é" * 4) == 2  # bytes, not characters


def test_chat_prompts_count_each_message_and_its_overhead() -> None:
    c = TokenCounter()
    body = {"messages": [
        {"role": "system", "content": "x" * 40},
        {"role": "user", "content": [{"type": "text", "text": "y" * 8},
                                     {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "content": None, "name": "bob",
         "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
    ]}  # fmt: skip
    tool = estimate('[{"id": "1", "function": {"name": "f", "arguments": "{}"}}]')
    expected = REPLY_PRIMING + 3 * MESSAGE_OVERHEAD + 10 + 2 + tool + estimate("bob")
    assert c.prompt_tokens(body, chat=True) == expected


def test_completions_prompts_strings_ids_and_batches() -> None:
    c = TokenCounter()
    assert c.prompt_tokens({"prompt": "z" * 16}, chat=False) == 4
    assert c.prompt_tokens({"prompt": [5, 6, 7]}, chat=False) == 3
    assert c.prompt_tokens({"prompt": ["zzzz", [1, 2]]}, chat=False) == 3
    assert c.prompt_tokens({"prompt": ""}, chat=False) == 1  # at least one
    assert prompt_count({"prompt": ["a", "b"]}) == 2 and prompt_count({"prompt": [1, 2]}) == 1


def word_level_tokenizer(path: Path) -> Path:
    """A tiny real tokenizer.json: whitespace words, unknown ones -> [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_a_tokenizer_json_counts_its_tokens(tmp_path: Path) -> None:
    count = load_tokenizer(word_level_tokenizer(tmp_path))
    assert count("hello world, hello") == 4  # hello world , hello
    assert count("") == 0
    c = TokenCounter(count)
    assert c.prompt_tokens({"prompt": "hello world"}, chat=False) == 2


def test_a_bad_tokenizer_file_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(InvalidArgument, match=r"^tokenizer: cannot load"):
        load_tokenizer(bad)
    with pytest.raises(InvalidArgument, match=r"^tokenizer: cannot load"):
        load_tokenizer(tmp_path / "missing.json")
