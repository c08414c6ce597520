"""The scale-out settings (docs/ha.md): defaults, the advertised address,
and bad values refused with the variable named."""

from __future__ import annotations

import os
import socket

import pytest
from pydantic import ValidationError

from controlplane.settings import Settings


def make(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    for key in list(os.environ):
        if key.startswith("BURSTGATE_HA_") or key == "BURSTGATE_ADVERTISE_ADDRESS":
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(f"BURSTGATE_{key}", value)
    return Settings(_env_file=None)  # type: ignore[call-arg]


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    s = make(monkeypatch, HOST="127.0.0.1", PORT="50051")
    assert (s.ha_lease_ttl_s, s.ha_margin_s, s.ha_cells) == (5.0, 1.0, None)
    assert s.ha_lone_lease_ttl_s == 30.0
    assert s.advertised() == "127.0.0.1:50051"
    assert s.advertised(41234) == "127.0.0.1:41234"  # the bound port, for port 0
    host, pid, rand = s.member_id().rsplit("-", 2)
    assert host == socket.gethostname() and pid == str(os.getpid()) and len(rand) == 6
    assert s.member_id() != s.member_id()  # a restart is a new member


def test_a_wildcard_host_is_advertised_by_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    for wildcard in ("0.0.0.0", "::"):
        s = make(monkeypatch, HOST=wildcard, PORT="7000")
        assert s.advertised() == f"{socket.gethostname()}:7000"
    assert make(monkeypatch, HOST="::1", PORT="7000").advertised() == "[::1]:7000"


def test_explicit_values(monkeypatch: pytest.MonkeyPatch) -> None:
    s = make(
        monkeypatch, ADVERTISE_ADDRESS="cp-1.internal:50051", HA_MEMBER_ID="cp-1",
        HA_LEASE_TTL_S="3", HA_MARGIN_S="0.5", HA_CELLS='{"eu": ["eu-1", "eu-2"]}',
    )  # fmt: skip
    assert s.advertised(1) == "cp-1.internal:50051" and s.member_id() == "cp-1"
    assert s.ha_cells == {"eu": ["eu-1", "eu-2"]}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"ADVERTISE_ADDRESS": "cp-1"}, "advertise_address"),
        ({"ADVERTISE_ADDRESS": "cp-1:0"}, "advertise_address"),
        ({"ADVERTISE_ADDRESS": "0.0.0.0:50051"}, "advertise_address"),
        ({"HA_MEMBER_ID": ""}, "ha_member_id"),
        ({"HA_LEASE_TTL_S": "0"}, "ha_lease_ttl_s"),
        ({"HA_MARGIN_S": "-1"}, "ha_margin_s"),
        ({"HA_LEASE_TTL_S": "1.5", "HA_MARGIN_S": "1"}, "BURSTGATE_HA_MARGIN_S"),
        ({"HA_CELLS": '{"eu": ["a"], "us": ["a"]}'}, "pool 'a' is listed in cells"),
        ({"HA_CELLS": '{"eu": []}'}, "ha_cells"),
        ({"HA_CELLS": "not json"}, "ha_cells"),
    ],
)
def test_bad_values_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    with pytest.raises(ValidationError, match=named):
        make(monkeypatch, **env)
