"""Declarative config files (YAML): lanes and tenants, applied as upserts.

``burstgate config apply FILE`` and the Quickstart's demo use this. The file
is validated in full (pydantic, then ``controlplane.domain.validate``) before
anything is written, and errors name the entry and field.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.errors import InvalidArgument
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


def load(path: Path) -> ConfigFile:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(str(path), f"cannot read config: {exc}") from exc
    try:
        return ConfigFile.model_validate(raw or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgument(f"{path}:{where}", first["msg"]) from exc


def apply(repo: ConfigRepository, cfg: ConfigFile, actor: Actor | None = None) -> tuple[int, int]:
    """Upsert lanes then tenants, each audited as ``actor`` (default
    ``local:<os user>``). Returns (tenants created, tenants updated)."""
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
    for lane in lanes:
        repo.upsert_lane(lane, actor)
    created = sum(repo.upsert_tenant(t, actor) for t in tenants)
    return created, len(tenants) - created
