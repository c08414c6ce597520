from __future__ import annotations

import pytest
from pydantic import ValidationError

from controlplane.settings import Settings, sqlalchemy_url


def test_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("BURSTGATE_DATABASE_URL", "BURSTGATE_PORT", "BURSTGATE_HOST"):
        monkeypatch.delenv(var, raising=False)
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.database_url == "sqlite:///var/burstgate.db"
    assert (s.host, s.port, s.metrics_port) == ("127.0.0.1", 50051, 9464)
    assert s.reservation_ttl_s == 600 and s.default_tenant is None


def test_bad_env_value_is_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTGATE_PORT", "70000")
    with pytest.raises(ValidationError, match="port"):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_postgres_urls_use_psycopg3() -> None:
    assert sqlalchemy_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sqlalchemy_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sqlalchemy_url("sqlite:///x.db") == "sqlite:///x.db"
