"""`config export`'s YAML: numbers stay numbers, and every Decimal reads back exactly."""

from __future__ import annotations

from decimal import Decimal

import yaml

from controlplane import configfile


def test_decimals_round_trip_exactly_and_read_as_numbers() -> None:
    rates = [Decimal("20000.000"), Decimal("12.5"), Decimal("0.123456789012345678")]
    cfg = configfile.parse(
        {"tenants": [{"tenant_id": f"t{i}", "token_rate": r, "burst_tokens": 1}
                     for i, r in enumerate(rates)]}
    )  # fmt: skip
    text = configfile.dump(cfg)
    assert "!!" not in text  # no explicit YAML tags for people to read
    raw = yaml.safe_load(text)
    # whole and binary-exact numbers are plain YAML numbers; the rest a string
    assert [t["token_rate"] for t in raw["tenants"]] == [20000, 12.5, "0.123456789012345678"]
    back = configfile.parse(raw)
    assert [t.token_rate for t in back.tenants] == rates
    assert back == cfg
