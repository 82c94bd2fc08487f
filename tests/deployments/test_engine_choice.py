"""`engine:` picks the replica backend; asking for vLLM where it is not installed says what to install."""

from __future__ import annotations

import sys

import pytest

from rayapp.config import AppConfig
from rayapp.deployments.engines import RayappBackend, backend_class


def test_engine_rayapp_is_rayapps_own_engine():
    assert backend_class(AppConfig()) is RayappBackend


def test_engine_vllm_without_vllm_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "rayapp.vllm_ext.engine", None)  # as if vLLM were not installed
    with pytest.raises(RuntimeError, match=r"`vllm` extra"):
        backend_class(AppConfig(engine="vllm"))


@pytest.mark.parametrize("engine", ["rayapp", "vllm"])
def test_a_dtype_outside_the_four_is_refused_naming_the_field(engine):
    with pytest.raises(ValueError, match=r"dtype\n.*'auto', 'float32', 'bfloat16' or 'float16'"):
        AppConfig(engine=engine, dtype="fp8")
