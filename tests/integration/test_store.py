"""Schema and config repository on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import column, inspect, table

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.errors import AlreadyExists, InvalidArgument, NotFound
from controlplane.store.config import ConfigRepository
from controlplane.store.db import downgrade, make_engine, upgrade
from controlplane.store.models import Base


def test_models_and_migrations_do_not_drift(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
        )
    engine.dispose()
    assert diff == []


def test_downgrade_to_base_and_back(migrated_url: str) -> None:
    downgrade(migrated_url, "base")
    engine = make_engine(migrated_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(migrated_url)
    assert {"tenants", "lanes"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_default_lanes_are_the_spec_defaults(migrated_url: str) -> None:
    repo = ConfigRepository(make_engine(migrated_url))
    lanes = {lane.name: lane for lane in repo.lanes()}
    assert {n: (lane.weight, lane.wait_target_ms) for n, lane in lanes.items()} == {
        "premium": (Decimal("0.40"), 200),
        "standard": (Decimal("0.45"), 800),
        "batch": (Decimal("0.15"), 5000),
    }
    assert lanes["premium"].fail_open and not lanes["standard"].fail_open
    repo.engine.dispose()


def test_tenant_repository(migrated_url: str) -> None:
    repo = ConfigRepository(make_engine(migrated_url))
    t = TenantConfig(
        tenant_id="acme",
        token_rate=Decimal("12.5"),
        burst_tokens=1000,
        hourly_quota=10_000,
        default_lane="batch",
    )
    repo.add_tenant(t)
    assert repo.get_tenant("acme").config == t
    with pytest.raises(AlreadyExists):
        repo.add_tenant(t)
    fp = repo.fingerprint()
    assert (
        repo.upsert_tenant(TenantConfig(tenant_id="acme", token_rate=Decimal(50), burst_tokens=500))
        is False
    )
    assert repo.get_tenant("acme").config.token_rate == Decimal(50)
    assert repo.fingerprint() != fp
    repo.set_enabled("acme", False)
    assert repo.get_tenant("acme").config.enabled is False
    with pytest.raises(NotFound):
        repo.get_tenant("nobody")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"token_rate": Decimal(0)}, "token_rate"),
        ({"token_rate": Decimal("0.0001")}, "token_rate"),
        ({"burst_tokens": 0}, "burst_tokens"),
        ({"hourly_quota": -5}, "hourly_quota"),
        ({"default_lane": "gold"}, "default_lane"),
        ({"tenant_id": ""}, "tenant_id"),
    ]
    for bad, field in cases:
        kw: dict[str, Any] = {"tenant_id": "new", "token_rate": Decimal(1), "burst_tokens": 10}
        with pytest.raises(InvalidArgument) as err:
            repo.add_tenant(TenantConfig(**(kw | bad)))
        assert err.value.field == field
    assert [x.tenant_id for x in repo.tenants()] == ["acme"]
    repo.upsert_lane(LaneConfig("bulk", 3, Decimal("0.05"), 60_000, False, True))
    assert [lane.name for lane in repo.lanes()][-1] == "bulk"
    with pytest.raises(InvalidArgument):
        repo.upsert_lane(LaneConfig("bad", 4, Decimal(2), 1, False, True))
    repo.engine.dispose()


OLD_TENANT = ("tenant_id", "display_name", "enabled", "token_rate", "burst_tokens",
              "default_lane", "shadow_mode", "created_at", "updated_at")  # fmt: skip


def test_tenant_and_lane_pools(db_url: str) -> None:
    # Rows written before migration 0005 come out with no configured pool.
    upgrade(db_url, "0004")
    engine = make_engine(db_url)
    now = datetime.now(UTC)
    with engine.begin() as conn:  # the 0004 schema: the models already have the column
        conn.execute(
            table("tenants", *(column(c) for c in OLD_TENANT)).insert(),
            [dict(zip(OLD_TENANT, ("old", "", True, 1, 10, "standard", False, now, now),
                      strict=True))],
        )  # fmt: skip
    upgrade(db_url)
    repo = ConfigRepository(engine)
    assert repo.get_tenant("old").config.pool is None
    assert {lane.pool for lane in repo.lanes()} == {None}
    t = TenantConfig(tenant_id="acme", token_rate=Decimal(1), burst_tokens=10, pool="gpu-a")
    repo.add_tenant(t)
    assert repo.get_tenant("acme").config == t
    assert repo.update_tenant("acme", {"pool": "gpu-b"}).config.pool == "gpu-b"
    assert repo.update_tenant("acme", {"pool": None}).config.pool is None  # cleared
    assert repo.update_tenant("old", {"pool": "p" * 128}).config.pool == "p" * 128
    repo.upsert_lane(LaneConfig("bulk", 3, Decimal("0.05"), 60_000, False, True, pool="gpu-c"))
    repo.update_lane("standard", {"pool": "gpu-d"})
    assert {lane.name: lane.pool for lane in repo.lanes()} == {
        "premium": None, "standard": "gpu-d", "batch": None, "bulk": "gpu-c",
    }  # fmt: skip
    repo.update_lane("bulk", {"pool": None})
    assert {lane.name: lane.pool for lane in repo.lanes()}["bulk"] is None
    for bad in ("", "p" * 129, "gpu\x00"):
        with pytest.raises(InvalidArgument) as err:
            repo.update_tenant("acme", {"pool": bad})
        assert err.value.field == "pool"
        with pytest.raises(InvalidArgument) as err:
            repo.update_lane("standard", {"pool": bad})
        assert err.value.field == "pool"
    assert repo.get_tenant("acme").config.pool is None
    assert {lane.name: lane.pool for lane in repo.lanes()}["standard"] == "gpu-d"
    engine.dispose()


def test_yaml_config_accepts_pools(migrated_url: str, tmp_path: Any) -> None:
    from controlplane import configfile

    repo = ConfigRepository(make_engine(migrated_url))
    path = tmp_path / "config.yaml"
    path.write_text(
        "lanes:\n- {name: bulk, priority: 3, weight: 0.05, wait_target_ms: 60000, pool: gpu-c}\n"
        "tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10, pool: gpu-a}\n"
        "- {tenant_id: b, token_rate: 1, burst_tokens: 10}\n"
    )
    assert configfile.apply(repo, configfile.load(path)) == (2, 0)
    assert {t.tenant_id: t.pool for t in repo.tenants()} == {"a": "gpu-a", "b": None}
    assert {lane.name: lane.pool for lane in repo.lanes()}["bulk"] == "gpu-c"
    # applied again without it: the pool is no longer configured
    path.write_text("tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10}\n")
    assert configfile.apply(repo, configfile.load(path)) == (0, 1)
    assert repo.get_tenant("a").config.pool is None
    repo.engine.dispose()


# Values the admin API refuses (INVALID_ARGUMENT naming the field) must be
# refused by the YAML path too: both go through controlplane.domain.validate.
YAML_REJECTS = [
    ("tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10, max_concurrency: 2147483648}\n",
     "tenants[0].max_concurrency"),
    ("tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10, max_wait_ms: 2147483648}\n",
     "tenants[0].max_wait_ms"),
    ("tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10, display_name: " + "x" * 257
     + "}\n", "tenants[0].display_name"),
    ("tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10, fallback_model: \"m\\u0007\"}\n",
     "tenants[0].fallback_model"),
    ("tenants:\n- {tenant_id: a, token_rate: 1.0001, burst_tokens: 10}\n",
     "tenants[0].token_rate"),
    ("lanes:\n- {name: bulk, priority: 2147483648, weight: 0.1, wait_target_ms: 1}\n",
     "lanes[0].priority"),
    ("lanes:\n- {name: bulk, priority: 3, weight: 0.12345, wait_target_ms: 1}\n",
     "lanes[0].weight"),
    ("lanes:\n- {name: bulk, priority: 3, weight: 0.1, wait_target_ms: 2147483648}\n",
     "lanes[0].wait_target_ms"),
    ("tenants:\n- {tenant_id: a, token_rate: 1, burst_tokens: 10, pool: \"\"}\n",
     "tenants[0].pool"),
    ("lanes:\n- {name: bulk, priority: 3, weight: 0.1, wait_target_ms: 1, pool: " + "p" * 129
     + "}\n", "lanes[0].pool"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "field"), YAML_REJECTS)
def test_yaml_config_rejects_what_the_admin_api_rejects(
    sqlite_url: str, tmp_path: Any, text: str, field: str
) -> None:
    from controlplane import configfile

    upgrade(sqlite_url)
    repo = ConfigRepository(make_engine(sqlite_url))
    before = (repo.tenants(), repo.lanes())
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as err:
        configfile.apply(repo, configfile.load(path))
    assert err.value.field == field
    assert (repo.tenants(), repo.lanes()) == before  # nothing written
    repo.engine.dispose()
