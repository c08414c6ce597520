"""The LiteLLM hook's configuration: ``BURSTGATE_LITELLM_*`` environment
variables over an optional YAML file named by ``BURSTGATE_LITELLM_CONFIG``
(pydantic-settings), validated in full when the proxy loads the callback.

A bad value fails the proxy's start with :class:`ConfigError`, whose message
names the field as the file spells it and its environment variable
(``tenant_from[0]: 'teamid' is not a rule; ...``). docs/litellm.md lists
every field.

Rules (``tenant_from``, ``lane_from``) say where a value is read, tried in
order, the first non-empty one wins:

- a field of the LiteLLM key (``UserAPIKeyAuth``): ``team_id``,
  ``team_alias``, ``key_alias``, ``key_name``, ``user_id``, ``user_email``,
  ``end_user_id``, ``org_id``, ``project_id``;
- ``metadata.<field>``: the key's metadata; ``team_metadata.<field>``: its
  team's; ``request_metadata.<field>``: the request body's ``metadata``;
  ``header.<name>``: a request header. The last two are the client's own
  say: fine for a lane (as the sidecar's lane header), a trust decision for
  a tenant.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from burstgate_client.errors import excerpt
from burstgate_client.sidecar.config import DEFAULT_LANES, LaneSettings

ENV_PREFIX = "BURSTGATE_LITELLM_"
CONFIG_ENV = "BURSTGATE_LITELLM_CONFIG"  # the YAML file's path

# The key's fields a rule may name (attributes of LiteLLM's UserAPIKeyAuth).
KEY_FIELDS = ("team_id", "team_alias", "key_alias", "key_name", "user_id", "user_email",
              "end_user_id", "org_id", "project_id")  # fmt: skip
# Sources that take a field name after the dot.
DOTTED = ("metadata", "team_metadata", "request_metadata", "header")


class ConfigError(ValueError):
    """The hook's configuration is bad; the message names the field."""


class TokenCounterName(StrEnum):
    # litellm.token_counter with its default tokenizer (tiktoken's
    # cl100k_base, bundled with litellm: no download), whatever the model
    LITELLM = "litellm"
    # one token per 4 UTF-8 bytes (the sidecar's estimate without a tokenizer)
    BYTES = "bytes"


@dataclass(frozen=True, slots=True)
class Rule:
    """Where a value is read: ``source`` is a key field or one of DOTTED;
    ``name`` the field (or header) after the dot, "" for a key field."""

    source: str
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> Rule:
        head, dot, name = text.partition(".")
        if not dot and head in KEY_FIELDS:
            return cls(head)
        if dot and head in DOTTED and name:
            return cls(head, name.lower() if head == "header" else name)
        fields = ", ".join(KEY_FIELDS)
        raise ValueError(
            f"{excerpt(text)} is not a rule; one of {fields}, or metadata.<field>, "
            "team_metadata.<field>, request_metadata.<field>, header.<name>"
        )

    def __str__(self) -> str:
        return f"{self.source}.{self.name}" if self.name else self.source


def _rules(value: Any) -> list[Rule]:
    """A list of rules, from YAML (a list or one string) or an environment
    variable (JSON, or comma-separated)."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",")]
    if not isinstance(value, list):
        raise ValueError("expected a list of rules")
    out = []
    for item in value:
        if isinstance(item, Rule):
            out.append(item)
        elif isinstance(item, str):
            out.append(Rule.parse(item))
        else:
            raise ValueError(f"expected a rule (a string), got {excerpt(item)}")
    return out


def _mapping(value: Any) -> Any:
    """An environment variable's JSON object (YAML gives a dict already)."""
    return json.loads(value) if isinstance(value, str) else value


class HookSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True
    )

    # The control plane (gRPC). api_key None: $BURSTGATE_API_KEY (a key of
    # role sidecar for the tenants this proxy serves, when auth is on).
    # One address, or several replicas' comma-separated (docs/ha.md).
    control_plane: str = Field(default="127.0.0.1:50051", min_length=1)
    api_key: str | None = None
    # Buffered Completes on disk while the control plane is unreachable
    # (the SDK's spool); None: in memory only.
    spool_path: Path | None = None

    # Who pays: the first rule that yields a value, mapped through
    # tenant_map (a value not in it is the tenant's id itself), else
    # default_tenant, else the request is refused (403).
    tenant_from: Annotated[list[Rule], NoDecode] = [Rule("team_id")]
    tenant_map: Annotated[dict[str, str], NoDecode] = {}
    default_tenant: str | None = Field(default=None, min_length=1)
    # The lane: the first rule that yields a value, else tenant_lanes[tenant],
    # else "" (the server's default lane of the tenant).
    lane_from: Annotated[list[Rule], NoDecode] = [
        Rule("request_metadata", "burstgate_lane"), Rule("metadata", "burstgate_lane"),
        Rule("team_metadata", "burstgate_lane"),
    ]  # fmt: skip
    tenant_lanes: Annotated[dict[str, str], NoDecode] = {}
    # Per lane: fail open or closed while the control plane is unreachable,
    # and the longest a request waits in burstgate's gate (the sidecar's).
    lanes: Annotated[dict[str, LaneSettings], NoDecode] = Field(
        default_factory=lambda: dict(DEFAULT_LANES)
    )
    default_lane: LaneSettings = LaneSettings()  # lanes not listed, and ""
    # The engine pool of a model group (LiteLLM's model_name): pools[group],
    # else default_pool, else the group's name itself.
    pools: Annotated[dict[str, str], NoDecode] = {}
    default_pool: str | None = Field(default=None, min_length=1, max_length=128)

    token_counter: TokenCounterName = TokenCounterName.LITELLM
    # Admitted (and sent as max_tokens) when a request names none.
    default_max_tokens: int = Field(default=1024, gt=0, le=10_000_000)
    # After a stream ends or its client leaves, how long LiteLLM's own usage
    # report may take before the hook settles with what it saw itself.
    settle_grace_s: float = Field(default=5.0, ge=0, le=600)
    limits_timeout_s: float = Field(default=0.05, gt=0, le=10)  # GetLimits for a 429's headers
    unavailable_retry_after_s: int = Field(default=1, ge=0, le=3600)  # fail-closed 503

    @field_validator("control_plane")
    @classmethod
    def _control_plane(cls, v: str) -> str:
        from burstgate_client.redirects import targets

        return ",".join(targets(v))  # ValueError when no address is left

    @field_validator("tenant_from", "lane_from", mode="before")
    @classmethod
    def _parse_rules(cls, v: Any) -> list[Rule]:
        return _rules(v)

    @field_validator("tenant_from")
    @classmethod
    def _some_rule(cls, v: list[Rule]) -> list[Rule]:
        if not v:
            raise ValueError("expected at least one rule")
        return v

    @field_validator("tenant_map", "tenant_lanes", "lanes", "pools", mode="before")
    @classmethod
    def _parse_mapping(cls, v: Any) -> Any:
        return _mapping(v)

    @field_validator("tenant_map", "tenant_lanes", "pools")
    @classmethod
    def _non_empty(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not key or not value:
                raise ValueError(f"empty key or value: {excerpt(key)}: {excerpt(value)}")
        return v

    def lane(self, name: str) -> LaneSettings:
        return self.lanes.get(name, self.default_lane)

    def pool_of(self, model_group: str) -> str:
        return self.pools.get(model_group) or self.default_pool or model_group

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:  # fmt: skip
        """Arguments, then the environment, then the YAML file (no .env: the
        proxy's own .env is LiteLLM's)."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, _EnvWithoutConfig(settings_cls)]
        path = os.environ.get(CONFIG_ENV)
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


class _EnvWithoutConfig(PydanticBaseSettingsSource):
    """The environment source, minus BURSTGATE_LITELLM_CONFIG (the file's
    path, not a field: extra="forbid" would refuse it)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        from pydantic_settings import EnvSettingsSource

        super().__init__(settings_cls)
        self._env = EnvSettingsSource(settings_cls)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._env.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        values = self._env()
        values.pop("config", None)
        return values


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def load(**overrides: Any) -> HookSettings:
    """The settings (``overrides`` first, then the environment, then the
    file). Raises ConfigError naming the field and its variable."""
    path = os.environ.get(CONFIG_ENV)
    if path and not Path(path).is_file():
        raise ConfigError(f"{CONFIG_ENV}: no such file: {path}")
    try:
        return HookSettings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = _where(first["loc"])
        top = str(first["loc"][0]) if first["loc"] else ""
        message = first["msg"].removeprefix("Value error, ")
        origin = f"{ENV_PREFIX}{top.upper()}" + (f" or `{top}:` in {path}" if path else "")
        raise ConfigError(f"burstgate litellm hook: {field}: {message} ({origin})") from None
    except (SettingsError, ValueError, yaml.YAMLError) as exc:  # a YAML or JSON that does not parse
        raise ConfigError(f"burstgate litellm hook: {path or 'environment'}: {exc}") from None
