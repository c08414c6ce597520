"""Which column holds what: generic aliases, built-in presets, explicit options.

Resolution, later layers winning per field: the generic aliases
(``COLUMN_ALIASES``), then the preset (named with ``--format`` or
recognised from the header / first objects by its identifying columns),
then ``--time-col`` and friends. JSON Lines columns may be dotted paths into
nested objects (``usage.prompt_tokens``); a key that itself contains a dot
is matched first. Names match exactly, else case-insensitively.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from controlplane.analysis.timeunits import TimeUnit

# Canonical field -> accepted column names (matched case-insensitively).
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "timestamp": ("timestamp", "arrival_time", "arrival_ts", "ts", "time"),
    "prompt_tokens": (
        "prompt_tokens",
        "contexttokens",
        "input_tokens",
        "input_length",
        "request tokens",
    ),
    "output_tokens": (
        "output_tokens",
        "generatedtokens",
        "generated_tokens",
        "completion_tokens",
        "output_length",
        "response tokens",
    ),
    "tenant": ("tenant", "tenant_id"),
    "lane": ("lane",),
    "decision": ("decision",),
    "queue_wait_ms": ("queue_wait_ms",),
    "latency_ms": ("latency_ms",),
    "queue_start": ("queue_start", "queue_start_ts"),
    "exec_start": ("exec_start", "exec_start_ts"),
    "end": ("end", "end_ts"),
    # One id per fixed-size block of the prompt (blockids.py): KV-cache traces.
    "block_ids": ("hash_ids", "block_ids", "block_hashes"),
}
# Fields the column options map, and the option that names each.
OPTION_FOR_FIELD = {
    "timestamp": "--time-col",
    "prompt_tokens": "--prompt-col",
    "output_tokens": "--output-col",
    "tenant": "--tenant-col",
    "lane": "--lane-col",
    "block_ids": "--block-ids-col",
}
# Columns that only identify a preset; they are not analysed.
IDENTIFYING_ONLY = ("request_id", "chat_id", "parent_chat_id")


class LogFormat(StrEnum):
    auto = "auto"
    azure = "azure"
    mooncake = "mooncake"
    bailian = "bailian"
    openai = "openai"
    ledger = "ledger"
    burstgpt = "burstgpt"


@dataclass(frozen=True, slots=True)
class Preset:
    name: LogFormat
    title: str
    # Canonical field -> alternative column names/paths (the first present wins).
    columns: Mapping[str, tuple[str, ...]]
    # Fields that must all be present for the preset to be recognised.
    identify: tuple[str, ...]
    # Unit of numeric timestamps that are offsets from the start (None: the data says).
    relative_unit: TimeUnit | None = None
    # Tokens per block of its block ids (None: the --block-size default).
    block_size: int | None = None


_BATCH = "response.body."  # OpenAI Batch API output lines wrap the response object
PRESETS: tuple[Preset, ...] = (
    Preset(
        LogFormat.ledger,
        "burstgate ledger export",
        {
            "timestamp": ("arrival_ts",),
            "prompt_tokens": ("prompt_tokens",),
            "output_tokens": ("output_tokens",),
            "tenant": ("tenant_id",),
            "lane": ("lane",),
            "decision": ("decision",),
            "queue_start": ("queue_start_ts",),
            "exec_start": ("exec_start_ts",),
            "end": ("end_ts",),
            "request_id": ("request_id",),
        },
        ("timestamp", "prompt_tokens", "output_tokens", "tenant", "request_id"),
    ),
    Preset(
        LogFormat.azure,
        "Azure LLM inference trace",
        {
            "timestamp": ("TIMESTAMP",),
            "prompt_tokens": ("ContextTokens",),
            "output_tokens": ("GeneratedTokens",),
        },
        ("timestamp", "prompt_tokens", "output_tokens"),
    ),
    Preset(
        LogFormat.burstgpt,
        "BurstGPT trace",
        {
            "timestamp": ("Timestamp",),
            "prompt_tokens": ("Request tokens",),
            "output_tokens": ("Response tokens",),
        },
        ("timestamp", "prompt_tokens", "output_tokens"),
        TimeUnit.s,
    ),
    # Alibaba's Qwen "Bailian" usage traces: Mooncake's columns plus the
    # conversation's chat ids, timestamps in seconds, 16-token blocks. Before
    # Mooncake, whose columns it also has.
    Preset(
        LogFormat.bailian,
        "Bailian (Qwen) usage trace",
        {
            "timestamp": ("timestamp",),
            "prompt_tokens": ("input_length",),
            "output_tokens": ("output_length",),
            "block_ids": ("hash_ids",),
            "chat_id": ("chat_id",),
            "parent_chat_id": ("parent_chat_id",),
        },
        ("timestamp", "prompt_tokens", "output_tokens", "chat_id", "parent_chat_id"),
        TimeUnit.s,
        block_size=16,
    ),
    # Mooncake's FAST'25 traces: milliseconds since the start, 512-token blocks.
    Preset(
        LogFormat.mooncake,
        "Mooncake trace",
        {
            "timestamp": ("timestamp",),
            "prompt_tokens": ("input_length",),
            "output_tokens": ("output_length",),
            "block_ids": ("hash_ids",),
        },
        ("timestamp", "prompt_tokens", "output_tokens"),
        TimeUnit.ms,
        block_size=512,
    ),
    Preset(
        LogFormat.openai,
        "OpenAI-style response log",
        {
            "timestamp": ("created", _BATCH + "created"),
            "prompt_tokens": ("usage.prompt_tokens", _BATCH + "usage.prompt_tokens"),
            "output_tokens": ("usage.completion_tokens", _BATCH + "usage.completion_tokens"),
            "tenant": ("user", _BATCH + "user"),
        },
        ("timestamp", "prompt_tokens", "output_tokens"),
    ),
)
PRESET_BY_NAME = {preset.name: preset for preset in PRESETS}


class ColumnError(ValueError):
    """A named column or preset does not fit the file (exit code 2)."""


@dataclass(frozen=True, slots=True)
class ColumnOptions:
    """What the user said about the input (all optional)."""

    log_format: LogFormat = LogFormat.auto
    mapping: Mapping[str, str] = field(default_factory=dict)  # canonical -> column
    time_unit: TimeUnit | None = None
    # Read block ids (analyze's prefix-cache figures); plan and forecast skip them.
    block_ids: bool = True


@dataclass(frozen=True, slots=True)
class Resolution:
    columns: dict[str, str]  # canonical -> column name / dotted path as found
    preset: Preset | None
    how: str  # "auto" | "option" | "none"

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.columns.items() if k in OPTION_FOR_FIELD)
        if self.preset is None:
            return f"columns by name ({shown or 'none recognised'})"
        how = "recognised by its columns" if self.how == "auto" else "--format"
        return f"{self.preset.title} (--format {self.preset.name}, {how}; {shown})"


class _Names:
    """Column names of a file (CSV header, or JSON keys and nested paths)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(dict.fromkeys(names))
        self._lower: dict[str, str] = {}
        for name in self.names:
            self._lower.setdefault(name.strip().lower(), name)

    def find(self, wanted: str) -> str | None:
        if wanted in self.names:
            return wanted
        return self._lower.get(wanted.strip().lower())

    def shown(self, limit: int = 12) -> str:
        extra = len(self.names) - limit
        listed = ", ".join(self.names[:limit]) or "(none)"
        return listed + (f", ... ({extra} more)" if extra > 0 else "")


def _preset_columns(preset: Preset, names: _Names) -> dict[str, str]:
    found: dict[str, str] = {}
    for canonical, candidates in preset.columns.items():
        for candidate in candidates:
            name = names.find(candidate)
            if name is not None:
                found[canonical] = name
                break
    return found


def _alias_columns(names: _Names) -> dict[str, str]:
    found: dict[str, str] = {}
    for canonical, aliases in COLUMN_ALIASES.items():
        for alias in aliases:
            name = names.find(alias)
            if name is not None:
                found[canonical] = name
                break
    return found


def resolve(column_names: Iterable[str], options: ColumnOptions) -> Resolution:
    """Map canonical fields to the file's columns; ColumnError if an option does not fit."""
    names = _Names(column_names)
    columns = _alias_columns(names)
    preset: Preset | None = None
    how = "none"
    if options.log_format is LogFormat.auto:
        for candidate in PRESETS:
            found = _preset_columns(candidate, names)
            if all(f in found for f in candidate.identify):
                preset, how = candidate, "auto"
                columns.update(found)
                break
    else:
        preset, how = PRESET_BY_NAME[options.log_format], "option"
        found = _preset_columns(preset, names)
        missing = [preset.columns[f][0] for f in preset.identify if f not in found]
        if missing:
            raise ColumnError(
                f"--format {preset.name}: no column {', '.join(missing)} "
                f"(found {names.shown()}); use --format auto or the --*-col options"
            )
        columns.update(found)
    for canonical, wanted in options.mapping.items():
        name = names.find(wanted)
        if name is None:
            raise ColumnError(
                f"{OPTION_FOR_FIELD[canonical]} {wanted}: no such column (found {names.shown()})"
            )
        columns[canonical] = name
    for identifying in IDENTIFYING_ONLY:
        columns.pop(identifying, None)
    if not options.block_ids:
        columns.pop("block_ids", None)
    return Resolution(columns, preset, how)


def missing_timestamp(column_names: Iterable[str]) -> ColumnError:
    names = _Names(column_names)
    wanted = ", ".join(COLUMN_ALIASES["timestamp"])
    return ColumnError(
        f"no timestamp column (looked for {wanted}; found {names.shown()}); name it with --time-col"
    )


def json_paths(obj: Mapping[str, object], prefix: str = "", depth: int = 5) -> list[str]:
    """Keys of a JSON object and dotted paths into its nested objects."""
    out: list[str] = []
    for key, value in obj.items():
        path = prefix + key
        out.append(path)
        if isinstance(value, dict) and depth > 1:
            out.extend(json_paths(value, path + ".", depth - 1))
    return out
