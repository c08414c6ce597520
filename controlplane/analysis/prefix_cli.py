"""``analyze``'s prefix-cache options and their checks (prefix.py has the model)."""

from __future__ import annotations

from typing import Annotated

import typer

from controlplane.analysis.prefix import DEFAULT_BLOCK_SIZE, PrefixParams

_PANEL = "Prefix cache (logs with block ids)"

BlockIdsColOpt = Annotated[
    str | None,
    typer.Option(
        "--block-ids-col",
        help="Column holding each request's block ids, a list (default: hash_ids, block_ids "
        "or block_hashes). JSON: a.b for nested.",
        rich_help_panel=_PANEL,
    ),
]
BlockSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        metavar="TOKENS",
        help=f"Tokens per block id (default: the preset's, e.g. Mooncake 512, Bailian 16; "
        f"else {DEFAULT_BLOCK_SIZE}).",
        rich_help_panel=_PANEL,
    ),
]
CacheBlocksOpt = Annotated[
    list[int] | None,
    typer.Option(
        "--cache-blocks",
        metavar="N",
        help="Also model an LRU cache of N blocks (repeatable). An unbounded cache is "
        "always modelled.",
        rich_help_panel=_PANEL,
    ),
]
KvCapacityOpt = Annotated[
    list[int] | None,
    typer.Option(
        "--kv-capacity-tokens",
        metavar="TOKENS",
        help="Also model an LRU cache of this many tokens of KV: TOKENS // block size "
        "blocks (repeatable).",
        rich_help_panel=_PANEL,
    ),
]
KvWindowOpt = Annotated[
    int,
    typer.Option(
        "--kv-window-seconds",
        metavar="N",
        help="Hit rate and load per N-second window (widened to whole steps of the "
        "timestamps' grid).",
        rich_help_panel=_PANEL,
    ),
]


class PrefixOptionError(ValueError):
    """An option value that cannot be used; the message names the option."""


def check_options(
    block_size: int | None,
    cache_blocks: list[int] | None,
    kv_capacity_tokens: list[int] | None,
    kv_window_seconds: int,
) -> None:
    """Refuse impossible values before the log is read."""
    if block_size is not None and block_size < 1:
        raise PrefixOptionError(f"--block-size must be at least 1 token (got {block_size})")
    for value in cache_blocks or []:
        if value < 1:
            raise PrefixOptionError(f"--cache-blocks must be at least 1 block (got {value})")
    for value in kv_capacity_tokens or []:
        if value < 1:
            raise PrefixOptionError(f"--kv-capacity-tokens must be at least 1 (got {value})")
    if kv_window_seconds < 1:
        raise PrefixOptionError(
            f"--kv-window-seconds must be a whole number of seconds, at least 1 "
            f"(got {kv_window_seconds})"
        )


def prefix_params(
    block_size: int | None,
    preset_block_size: int | None,
    cache_blocks: list[int] | None,
    kv_capacity_tokens: list[int] | None,
    kv_window_seconds: int,
) -> PrefixParams:
    """The model's parameters, once the log (and so its preset's block size) is known."""
    size = block_size or preset_block_size or DEFAULT_BLOCK_SIZE
    capacities = list(cache_blocks or [])
    for tokens in kv_capacity_tokens or []:
        if tokens < size:
            raise PrefixOptionError(
                f"--kv-capacity-tokens {tokens:,} holds no whole block of {size:,} tokens "
                "(--block-size)"
            )
        capacities.append(tokens // size)
    return PrefixParams(
        block_size=block_size,
        cache_blocks=tuple(sorted(set(capacities))),
        window_seconds=kv_window_seconds,
    )
