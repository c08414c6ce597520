"""The mapping file: validation naming the field, live reload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controlplane.domain.errors import InvalidArgument
from controlplane.integrations.envoy.config import LiveConfig, load, parse


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"domian": "x"}, "envoy config:domian"),
        ({"descriptors": {"tenant": "k", "lane": "k"}}, "envoy config:descriptors"),
        ({"defaults": {"estimate_tokens": 0}}, "envoy config:defaults.estimate_tokens"),
        ({"max_wait_ms": -1}, "envoy config:max_wait_ms"),
    ],
)
def test_errors_name_the_field(raw: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse(raw)
    assert err.value.field == field


def test_the_shipped_example_is_valid() -> None:
    cfg = load(Path(__file__).resolve().parents[3] / "deploy" / "envoy" / "burstgate-envoy.yaml")
    assert cfg.domain == "burstgate" and cfg.descriptors.phase == "phase"


def test_live_reload_keeps_the_last_good_file(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text("domain: one\n")
    live = LiveConfig(path)
    assert (live.current.domain, live.poll()) == ("one", False)  # unchanged
    path.write_text("domain: two\n")
    os.utime(path, ns=(1, 1))  # a new stamp even within the clock's resolution
    assert live.poll() and live.current.domain == "two"
    path.write_text("domain: [not, a, string]\n")
    os.utime(path, ns=(2, 2))
    assert not live.poll()
    assert (live.current.domain, live.reload_failures) == ("two", 1)
