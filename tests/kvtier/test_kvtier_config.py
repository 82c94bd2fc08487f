"""KVTierConfig: defaults that start the embedded database, and errors that say what to change."""

from __future__ import annotations

import dataclasses

import pytest

from rayapp.config import KVTierConfig


def test_defaults_use_the_embedded_database():
    config = KVTierConfig()
    assert config.enabled and config.dsn is None and config.data_dir is None
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
