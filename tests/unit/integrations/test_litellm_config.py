"""The LiteLLM hook's settings: environment over the YAML file, rules
parsed, and every bad value named by its field and its variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from burstgate_client.litellm.config import ConfigError, HookSettings, Rule, load
from burstgate_client.sidecar.config import FailPolicyName


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("BURSTGATE_LITELLM_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = load()
    assert s.control_plane == "127.0.0.1:50051"
    assert s.tenant_from == [Rule("team_id")]
    assert [str(r) for r in s.lane_from] == [
        "request_metadata.burstgate_lane", "metadata.burstgate_lane",
        "team_metadata.burstgate_lane"]  # fmt: skip
    assert s.lane("premium").fail_policy is FailPolicyName.OPEN
    assert s.lane("unknown") == s.default_lane
    assert s.pool_of("gpt-4o") == "gpt-4o"  # the model group's name


def test_environment_over_the_yaml_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "hook.yaml"
    f.write_text("tenant_from: [key_alias]\npools: {big: gpu-a}\ndefault_pool: shared\n"
                 "tenant_map: {team-1: acme}\n")  # fmt: skip
    monkeypatch.setenv("BURSTGATE_LITELLM_CONFIG", str(f))
    monkeypatch.setenv("BURSTGATE_LITELLM_TENANT_FROM", "team_id, header.X-Tenant")
    monkeypatch.setenv("BURSTGATE_LITELLM_CONTROL_PLANE", "cp:50051")
    s = load()
    assert s.tenant_from == [Rule("team_id"), Rule("header", "x-tenant")]  # the environment's
    assert s.control_plane == "cp:50051"
    assert (s.pool_of("big"), s.pool_of("small")) == ("gpu-a", "shared")  # the file's
    assert s.tenant_map == {"team-1": "acme"}


def test_json_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTGATE_LITELLM_LANE_FROM", '["metadata.lane"]')
    monkeypatch.setenv("BURSTGATE_LITELLM_LANES", '{"gold": {"fail_policy": "open"}}')
    s = load()
    assert s.lane_from == [Rule("metadata", "lane")]
    assert s.lane("gold").fail_policy is FailPolicyName.OPEN


@pytest.mark.parametrize(("env", "value", "named"), [
    ("TENANT_FROM", "teamid", "tenant_from: 'teamid' is not a rule"),
    ("TENANT_FROM", "metadata.", "tenant_from: 'metadata.' is not a rule"),
    ("TENANT_FROM", "[]", "tenant_from: expected at least one rule"),
    ("LANES", '{"premium": {"max_wait_ms": -1}}', "lanes.premium.max_wait_ms:"),
    ("LANES", '{"premium": {"fail_policy": "maybe"}}', "lanes.premium.fail_policy:"),
    ("DEFAULT_MAX_TOKENS", "0", "default_max_tokens:"),
    ("TOKEN_COUNTER", "words", "token_counter:"),
    ("POOLS", '{"a": ""}', "pools: empty key or value"),
    ("SETTLE_GRACE_S", "-1", "settle_grace_s:"),
])  # fmt: skip
def test_bad_values_name_the_field_and_variable(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, named: str
) -> None:
    monkeypatch.setenv(f"BURSTGATE_LITELLM_{env}", value)
    with pytest.raises(ConfigError) as err:
        load()
    assert named in str(err.value)
    assert f"BURSTGATE_LITELLM_{env}" in str(err.value)


def test_bad_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BURSTGATE_LITELLM_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="BURSTGATE_LITELLM_CONFIG: no such file"):
        load()
    f = tmp_path / "hook.yaml"
    f.write_text("tenant_form: [team_id]\n")  # a typo
    monkeypatch.setenv("BURSTGATE_LITELLM_CONFIG", str(f))
    with pytest.raises(ConfigError, match=r"tenant_form: Extra inputs .*`tenant_form:` in "):
        load()
    f.write_text("tenant_from: [team_id\n")
    with pytest.raises(ConfigError):
        load()


def test_settings_are_frozen() -> None:
    s = HookSettings()
    with pytest.raises(ValueError):
        s.default_max_tokens = 3
