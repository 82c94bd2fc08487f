"""KVTierConfig: off by default, the embedded database when on without a dsn, errors that say what to change."""

from __future__ import annotations

import dataclasses

import pytest

from rayapp.config import AppConfig, EngineConfig, KVTierConfig
from rayapp.config.engine import KVTIER_DSN_ENV


def test_off_by_default_and_on_it_uses_the_embedded_database():
    config = KVTierConfig()
    assert not config.enabled and config.dsn is None and config.data_dir is None
    assert config.capacity_bytes == 2 << 30 and config.min_load_tokens == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.enabled = False


@pytest.mark.parametrize(
    "options, advice",
    [
        ({"dsn": "  "}, "unset it for the embedded database"),
        ({"capacity_bytes": 0}, "capacity_bytes=0 must be >= 1"),
        ({"data_dir": ""}, "unset it for the default"),
        ({"dsn": "host=db", "data_dir": "/var/lib/x"}, "unset it when kvtier.dsn is set"),
        ({"min_load_tokens": 0}, "min_load_tokens=0 must be >= 1"),
    ],
)
def test_bad_settings_name_the_fix(options, advice):
    with pytest.raises(ValueError, match=advice):
        KVTierConfig(**options)


def test_an_external_server_needs_only_its_dsn():
    config = KVTierConfig(dsn="postgresql://rayapp@opengauss:5432/rayapp", capacity_bytes=1 << 30)
    assert config.dsn.startswith("postgresql://") and config.capacity_bytes == 1 << 30


def test_the_section_reaches_the_engine_from_the_app_config_and_the_offline_options():
    app = AppConfig(kvtier={"enabled": True, "dsn": "host=db", "min_load_tokens": 64})
    assert app.engine_config().kvtier == KVTierConfig(enabled=True, dsn="host=db", min_load_tokens=64)
    assert AppConfig().engine_config().kvtier == KVTierConfig()
    assert set(AppConfig.model_fields["kvtier"].annotation.model_fields) == {
        f.name for f in dataclasses.fields(KVTierConfig)
    }
    assert EngineConfig.from_options(block_size=32, kvtier={"enabled": True}).kvtier.enabled
    with pytest.raises(ValueError, match="kvtier.min_load_tokens"):
        AppConfig(kvtier={"min_load_tokens": 0})
    with pytest.raises(ValueError, match="kvtier must be a dict"):
        EngineConfig.from_options(kvtier=True)


def test_the_dsn_can_come_from_the_replicas_environment(monkeypatch):
    monkeypatch.setenv(KVTIER_DSN_ENV, "host=opengauss port=5432 user=rayapp password=secret")
    # A Secret mounted as RAYAPP_KVTIER_DSN reaches the engine while the Serve config names no server.
    dsn = "host=opengauss port=5432 user=rayapp password=secret"
    assert AppConfig(kvtier={"enabled": True}).engine_config().kvtier.dsn == dsn
    assert EngineConfig.from_options(kvtier={"enabled": True}).kvtier.dsn.startswith("host=opengauss")
    # Explicit settings win: a dsn of its own, or a data_dir that asks for the embedded database.
    assert AppConfig(kvtier={"dsn": "host=db"}).engine_config().kvtier.dsn == "host=db"
    assert AppConfig(kvtier={"data_dir": "/var/lib/db"}).engine_config().kvtier.dsn is None
    assert KVTierConfig.from_env({}, enabled=True).dsn is None
