"""The `sparse` section: one set of field names in the engine, the app config and the environment."""

import dataclasses

import pytest
from pydantic import ValidationError

from rayapp.config import AppConfig, EngineConfig, SparseConfig, SparseSettings


def test_defaults_follow_retrievalkv():
    c = SparseConfig()
    assert (c.enabled, c.init_tokens, c.local_tokens, c.topk_percent) == (False, 1024, 7192, 0.2)
    assert (c.retrieval_block_size, c.dense_boundary, c.offload_boundary, c.retrieval_stride) == (128, 32768, 65536, 1)


def test_app_config_and_engine_config_share_field_names():
    assert set(SparseSettings.model_fields) == {f.name for f in dataclasses.fields(SparseConfig)}
    for name, info in SparseSettings.model_fields.items():
        assert info.description, name


def test_environment_names_of_the_vllm_plugin_are_read(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora, retrieval")
    monkeypatch.setenv("VLLM_RETRIEVAL_INIT_TOKENS_NUM", "64")
    monkeypatch.setenv("VLLM_RETRIEVAL_LOCAL_TOKENS_NUM", "512")
    monkeypatch.setenv("VLLM_RETRIEVAL_TOPK_PERCENT", "0.1")
    monkeypatch.setenv("VLLM_RETRIEVAL_DENSE_BOUNDARY", "1024")
    monkeypatch.setenv("VLLM_RETRIEVAL_OFFLOAD_BOUNDARY", "2048")
    c = EngineConfig.from_options(sparse={"retrieval_block_size": 64}).sparse
    assert (c.enabled, c.init_tokens, c.local_tokens, c.topk_percent) == (True, 64, 512, 0.1)
    assert (c.dense_boundary, c.offload_boundary, c.retrieval_block_size) == (1024, 2048, 64)
    # Explicit settings win over the environment, in the offline API and in the app config.
    assert EngineConfig.from_options(sparse={"init_tokens": 32}).sparse.init_tokens == 32
    app = AppConfig(sparse={"topk_percent": 0.3})
    assert app.engine_config().sparse.topk_percent == 0.3 and app.engine_config().sparse.init_tokens == 64


def test_plugins_without_retrieval_leave_it_off(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "retrieval_x")
    assert not SparseConfig.from_env().enabled


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_RETRIEVAL_TOPK_PERCENT", "lots")
    with pytest.raises(ValueError, match="VLLM_RETRIEVAL_TOPK_PERCENT.*sparse.topk_percent"):
        SparseConfig.from_env()


@pytest.mark.parametrize(
    "fields,names",
    [
        (
            {"init_tokens": 1024, "local_tokens": 1024, "dense_boundary": 2048},
            ["init_tokens", "local_tokens", "dense_boundary"],
        ),
        ({"dense_boundary": 4096, "offload_boundary": 2048}, ["offload_boundary", "dense_boundary"]),
        ({"topk_percent": 0.0}, ["topk_percent"]),
        ({"topk_percent": 1.5}, ["topk_percent"]),
        ({"representation": "median"}, ["representation"]),
        ({"retrieval_block_size": 96, "representative_keys": 5}, ["retrieval_block_size", "representative_keys"]),
    ],
)
def test_inconsistent_values_are_rejected_naming_the_fields(fields, names):
    with pytest.raises(ValueError) as err:
        SparseConfig(**fields)
    for name in names:
        assert name in str(err.value)


def test_retrieval_block_must_be_whole_pages():
    with pytest.raises(ValueError, match="retrieval_block_size=24 must be a multiple of block_size=16"):
        EngineConfig.from_options(sparse={"retrieval_block_size": 24, "representative_keys": 1})
    with pytest.raises(ValidationError, match="retrieval_block_size"):
        AppConfig(block_size=32, sparse={"retrieval_block_size": 48, "representative_keys": 1})


def test_unknown_sparse_option_lists_accepted_ones():
    with pytest.raises(ValueError, match="unknown sparse option.*'topk'.*accepted"):
        EngineConfig.from_options(sparse={"topk": 0.1})
