"""The sidecar's YAML config and flags: defaults, precedence, and errors
that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from burstgate_client.errors import InvalidArgument
from burstgate_client.sidecar.config import FailPolicyName, load


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sidecar.yaml"
    p.write_text(text)
    return p


def test_flags_alone_and_the_defaults() -> None:
    cfg = load(upstream="http://127.0.0.1:8000/v1", control_plane="127.0.0.1:50051")
    assert cfg.upstream == "http://127.0.0.1:8000"  # an OpenAI base_url is accepted
    assert cfg.lane("premium").fail_policy is FailPolicyName.OPEN
    assert cfg.lane("premium").max_wait_ms == 750
    assert cfg.lane("standard").fail_policy is FailPolicyName.CLOSED
    assert cfg.lane("no-such-lane") == cfg.default_lane
    assert cfg.tenant_header is None and cfg.pool == "default"  # off unless configured
    assert cfg.lane_header == "x-burstgate-lane"


def test_the_file_then_the_flags_over_it(tmp_path: Path) -> None:
    path = write(tmp_path, """
upstream: http://engine:8000
control_plane: cp:50051
api_keys: {sk-a: acme, sk-b: agentco}
tenant_header: X-Tenant
lane_header: null
tenant_lanes: {agentco: batch}
pool: gpu-a
lanes:
  premium: {fail_policy: open, max_wait_ms: 100}
default_lane: {fail_policy: open}
metrics: {interval_s: 0.1, engine: sglang, names: {queue_depth: my_waiting}, max_num_seqs: 64}
""")
    cfg = load(path, port=9000, pool=None)
    assert cfg.port == 9000 and cfg.pool == "gpu-a"  # a flag left out (None) changes nothing
    assert cfg.api_keys == {"sk-a": "acme", "sk-b": "agentco"}
    assert cfg.tenant_header == "x-tenant" and cfg.lane_header is None
    assert cfg.lane("premium").max_wait_ms == 100 and cfg.lane("standard") == cfg.default_lane
    assert cfg.metrics.names == {"queue_depth": "my_waiting"}
    assert load(path, upstream="http://other:1").upstream == "http://other:1"


@pytest.mark.parametrize(
    ("text", "flags", "field"),
    [
        ("control_plane: cp:1\n", {}, "--upstream"),
        ("upstream: http://e:1\n", {}, "--control-plane"),
        ("", {"upstream": "ftp://e:1", "control_plane": "c:1"}, "--upstream"),
        ("upstream: http://e:1/api\ncontrol_plane: c:1\n", {}, "sidecar.yaml: upstream"),
        ("upstream: http://e:1\ncontrol_plane: c:1\nlanes: {premium: {max_wait_ms: -1}}\n", {},
         "sidecar.yaml: lanes.premium.max_wait_ms"),
        ("upstream: http://e:1\ncontrol_plane: c:1\nlanes: {premium: {fail_policy: maybe}}\n",
         {}, "sidecar.yaml: lanes.premium.fail_policy"),
        ("upstream: http://e:1\ncontrol_plane: c:1\nmetrics: {names: {queue: x}}\n", {},
         "sidecar.yaml: metrics.names"),
        ("upstream: http://e:1\ncontrol_plane: c:1\nmetrics: {engine: triton}\n", {},
         "sidecar.yaml: metrics.engine"),
        ("upstream: http://e:1\ncontrol_plane: c:1\ntenant_header: 'bad header'\n", {},
         "sidecar.yaml: tenant_header"),
        ("upstream: http://e:1\ncontrol_plane: c:1\napi_keys: {k: ''}\n", {},
         "sidecar.yaml: api_keys"),
        ("upstream: http://e:1\ncontrol_plane: c:1\nsurprise: 1\n", {}, "sidecar.yaml: surprise"),
        ("upstream: http://e:1\ncontrol_plane: c:1\n", {"port": 70000}, "--port"),
        ("- a list\n", {}, "--config"),
        ("upstream: [\n", {}, "--config"),
    ],
)
def test_errors_name_the_field(
    tmp_path: Path, text: str, flags: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        load(write(tmp_path, text), **flags)
    assert str(err.value).startswith(field.replace("sidecar.yaml", str(tmp_path / "sidecar.yaml")))


def test_a_missing_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"^--config: cannot read"):
        load(tmp_path / "nope.yaml")
