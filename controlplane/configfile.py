"""Declarative config files (YAML): lanes, tenants and policy overrides,
applied as upserts.

``burstgate config apply FILE`` and the Quickstart's demo use this;
``burstgate config export`` writes the live configuration in the same form,
so export -> edit -> ``apply --dry-run`` -> apply is a round trip. The file
is validated in full (pydantic, then ``controlplane.domain.validate`` and the
policy's own rules) before anything is written, and errors name the entry and
field.

Semantics (upsert): every lane and tenant in the file is created or has *all*
its settings replaced (a field left out takes its default); lanes and tenants
not in the file are left as they are; ``policy`` keys in the file are set,
keys not in it keep their current override or default.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.policy import POLICY_KEYS, Policy, effective_policy, typed_value
from controlplane.domain.validate import check_lane, check_tenant
from controlplane.store.config import ConfigRepository

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


class LaneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=32)
    priority: int = Field(ge=0)
    weight: Decimal = Field(gt=0, le=1)
    wait_target_ms: int = Field(ge=0)
    fail_open: bool = False
    degradable: bool = True
    max_queued: int | None = Field(default=None, ge=0)
    pool: str | None = None  # engine pool; checked by domain.validate.check_pool


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: str = Field(min_length=1, max_length=128)
    display_name: str = ""
    enabled: bool = True
    token_rate: Decimal = Field(gt=0)
    burst_tokens: int = Field(ge=1)
    hourly_quota: int | None = Field(default=None, gt=0)
    daily_quota: int | None = Field(default=None, gt=0)
    max_concurrency: int | None = Field(default=None, gt=0)
    max_queued: int | None = Field(default=None, gt=0)
    max_tokens_per_request: int | None = Field(default=None, gt=0)
    default_lane: str = "standard"
    shadow_mode: bool = False
    dedicated_quota: int | None = Field(default=None, gt=0)
    fallback_model: str | None = None
    max_wait_ms: int | None = Field(default=None, ge=0)
    long_request_tokens: int | None = Field(default=None, gt=0)
    demote_long_requests: bool = True
    pool: str | None = None


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lanes: list[LaneSpec] = []
    tenants: list[TenantSpec] = []
    # Policy overrides (key: JSON value), as `burstgate admin policy set` takes them.
    policy: dict[str, Any] = {}


def load(path: Path) -> ConfigFile:
    """Read a config file; ``-`` reads standard input. Errors name the file
    and line: ``demo.yaml:12: tenants[1].token_rte: unknown field; did you
    mean token_rate?``."""
    where = "<stdin>" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(where, f"cannot read config: {exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise InvalidArgument(at, f"not valid YAML: {problem}") from exc
    except yaml.YAMLError as exc:
        raise InvalidArgument(where, f"not valid YAML: {exc}") from exc
    return parse(raw, where, text)


def parse(raw: Any, where: str = "config", text: str | None = None) -> ConfigFile:
    """Validate a loaded document; ``text`` (the YAML it came from) lets an
    error name its line."""
    if raw is not None and not isinstance(raw, dict):
        raise InvalidArgument(where, f"expected a mapping with lanes/tenants/policy, "
                              f"got a YAML {type(raw).__name__}")  # fmt: skip
    try:
        return ConfigFile.model_validate(raw or {})
    except ValidationError as exc:
        errors = exc.errors()
        # A misspelt key first: it is also why a required field is "missing".
        first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        loc = tuple(first["loc"])
        line = _line_of(text, loc) if text is not None else None
        at = f"{where}:{line}" if line is not None else where
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "unknown field" + _did_you_mean(str(loc[-1]), _fields_at(loc[:-1]))
        raise InvalidArgument(f"{at}: {_path(loc)}", message) from exc


def _path(loc: tuple[Any, ...]) -> str:
    """("tenants", 1, "token_rte") -> tenants[1].token_rte"""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model at ``loc`` (the file, a lane or a tenant)."""
    model: type[BaseModel] = ConfigFile
    if loc and loc[0] in ("lanes", "tenants"):
        model = LaneSpec if loc[0] == "lanes" else TenantSpec
    return list(model.model_fields)


def _did_you_mean(word: str, choices: list[str]) -> str:
    """``; did you mean X?`` for the closest of ``choices`` (difflib's
    ratio >= 0.6), else the list of them."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else f"; expected one of {', '.join(choices)}"


def _line_of(text: str, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of ``loc`` in the YAML ``text`` (the key's line for
    a mapping entry), as far down as the document goes; None if unknown."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(part)]
            if not match:
                break
            key, node = match[0]
            line = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def apply(
    repo: ConfigRepository,
    cfg: ConfigFile,
    actor: Actor | None = None,
    base_policy: Policy | None = None,
) -> tuple[int, int]:
    """Upsert lanes, tenants and policy keys, each audited as ``actor``
    (default ``local:<os user>``); ``base_policy`` is the server's policy
    before overrides (the settings'). Returns (tenants created, tenants
    updated)."""
    lanes, tenants = _validated(repo, cfg)
    base = base_policy or Policy()
    if cfg.policy:  # checked before anything is written
        _policy_changes(repo, cfg, base)
    for lane in lanes:
        repo.upsert_lane(lane, actor)
    created = sum(repo.upsert_tenant(t, actor) for t in tenants)
    if cfg.policy:
        repo.update_policy(base, cfg.policy, [], actor)
    return created, len(tenants) - created


def _validated(
    repo: ConfigRepository, cfg: ConfigFile
) -> tuple[list[LaneConfig], list[TenantConfig]]:
    lanes = [LaneConfig(**spec.model_dump()) for spec in cfg.lanes]
    tenants = [TenantConfig(**spec.model_dump()) for spec in cfg.tenants]
    lane_names = {lane.name for lane in repo.lanes()} | {lane.name for lane in lanes}
    # Validate everything before writing anything, with the same validators
    # as the admin API and the CLI; errors name the entry and the field.
    for i, lane in enumerate(lanes):
        try:
            check_lane(lane)
        except InvalidArgument as exc:
            raise InvalidArgument(f"lanes[{i}].{exc.field}", str(exc)) from exc
    for i, t in enumerate(tenants):
        try:
            check_tenant(t, lane_names)
        except InvalidArgument as exc:
            raise InvalidArgument(f"tenants[{i}].{exc.field}", str(exc)) from exc
    return lanes, tenants


# ------------------------------------------------------------------ export


def export(repo: ConfigRepository) -> ConfigFile:
    """The live configuration as a file ``apply`` accepts (and would not change)."""
    return ConfigFile(
        lanes=[LaneSpec(**dataclasses.asdict(lane)) for lane in repo.lanes()],
        tenants=[TenantSpec(**dataclasses.asdict(t)) for t in repo.tenants()],
        policy=repo.policy_overrides(),
    )


class _Dumper(yaml.SafeDumper):
    pass


def _decimal(dumper: yaml.SafeDumper, value: Decimal) -> yaml.ScalarNode:
    # A plain YAML number when a float reads back as the same Decimal (0.45,
    # 20000); otherwise a quoted string, which pydantic parses exactly.
    text = format(value.normalize(), "f")  # 0.4500 -> 0.45, 2E+4 -> 20000
    if "." not in text:
        return dumper.represent_scalar("tag:yaml.org,2002:int", text)
    if Decimal(repr(float(value))) == value:
        return dumper.represent_scalar("tag:yaml.org,2002:float", text)
    return dumper.represent_str(text)


_Dumper.add_representer(Decimal, _decimal)


def dump(cfg: ConfigFile, header: str = "") -> str:
    """YAML text of ``cfg``: each entry's fields in schema order, defaults left out."""
    body: dict[str, Any] = {
        "lanes": [spec.model_dump(exclude_defaults=True) for spec in cfg.lanes],
        "tenants": [spec.model_dump(exclude_defaults=True) for spec in cfg.tenants],
    }
    if cfg.policy:
        body["policy"] = dict(sorted(cfg.policy.items()))
    text = yaml.dump(body, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    return (header + text) if header else text


# -------------------------------------------------------------------- diff


@dataclass(frozen=True, slots=True)
class Change:
    """One entry the file would create or change: ``fields`` maps each
    changed field to (before, after); ``before`` is None on a create."""

    kind: str  # lane | tenant | policy
    name: str  # the lane or tenant; "" for the policy
    action: str  # create | update
    fields: dict[str, tuple[Any, Any]]


def diff(
    repo: ConfigRepository, cfg: ConfigFile, base_policy: Policy | None = None
) -> list[Change]:
    """What ``apply(repo, cfg)`` would change, validated as ``apply`` does;
    nothing is written."""
    lanes, tenants = _validated(repo, cfg)
    changes: list[Change] = []
    current_lanes = {lane.name: lane for lane in repo.lanes()}
    for lane in lanes:
        changes.extend(_entry("lane", lane.name, current_lanes.get(lane.name), lane))
    current_tenants = {t.tenant_id: t for t in repo.tenants()}
    for t in tenants:
        changes.extend(_entry("tenant", t.tenant_id, current_tenants.get(t.tenant_id), t))
    if cfg.policy:
        fields = _policy_changes(repo, cfg, base_policy or Policy())
        if fields:
            changes.append(Change("policy", "", "update", fields))
    return changes


def _entry(kind: str, name: str, before: Any, after: Any) -> list[Change]:
    new = dataclasses.asdict(after)
    if before is None:
        return [Change(kind, name, "create", {k: (None, v) for k, v in new.items()})]
    old = dataclasses.asdict(before)
    fields = {k: (old[k], v) for k, v in new.items() if old[k] != v}
    return [Change(kind, name, "update", fields)] if fields else []


def _policy_changes(
    repo: ConfigRepository, cfg: ConfigFile, base: Policy
) -> dict[str, tuple[Any, Any]]:
    """Validate the file's policy keys as ``update_policy`` will; return the
    effective values that change."""
    for key in cfg.policy:
        if key not in POLICY_KEYS:
            raise InvalidArgument(f"policy.{key}", "unknown policy key"
                                  + _did_you_mean(key, sorted(POLICY_KEYS)))  # fmt: skip
    typed = {k: typed_value(k, v, f"policy.{k}") for k, v in cfg.policy.items()}
    current = repo.policy_overrides()
    old = effective_policy(base, current).model_dump()
    try:
        new = effective_policy(base, current | typed).model_dump()
    except InvalidArgument as exc:
        raise InvalidArgument(f"policy.{exc.field}", exc.description) from exc
    return {k: (old[k], new[k]) for k in typed if old[k] != new[k]}
