"""The `sparse` section: one set of field names in the engine, the app config and the environment."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rayapp.config import AppConfig, EngineConfig, SparseConfig, SparseSettings


def _counts(c: SparseConfig) -> tuple:
    return c.init_tokens, c.local_tokens, c.dense_boundary, c.offload_boundary


def test_defaults_follow_retrievalkv_scaled_to_the_models_context():
    c = SparseConfig()
    assert (c.enabled, c.topk_percent, c.retrieval_block_size, c.retrieval_stride) == (False, 0.2, 128, 1)
    assert _counts(c) == (None, None, None, None) and not c.resolved
    # The RetrievalKV plugin's values at 128K and beyond; a shorter context scales them (whole 16-token pages).
    assert _counts(c.for_context(131072)) == (1024, 7192, 32768, 65536)
    assert _counts(c.for_context(1 << 20)) == (1024, 7192, 32768, 65536)
    assert _counts(c.for_context(32768)) == (256, 1792, 8192, 16384)
    assert _counts(c.for_context(8192)) == (64, 448, 2048, 4096)
    assert c.for_context(32768).resolved


def test_counts_set_stay_and_move_what_they_must():
    c = SparseConfig(dense_boundary=20000).for_context(32768)
    assert _counts(c) == (256, 1792, 20000, 20000)  # offload never below the dense boundary set
    assert _counts(SparseConfig(init_tokens=0, local_tokens=512).for_context(32768)) == (0, 512, 8192, 16384)
    with pytest.raises(ValueError, match="init_tokens \\+ local_tokens.*context of 8192 tokens"):
        SparseConfig(init_tokens=1024, local_tokens=7192).for_context(8192)


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
        ({"dense_boundary": 0}, ["dense_boundary"]),
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


def test_the_long_context_example_starts_sparse_at_a_quarter_of_its_models_context():
    text = (Path(__file__).parents[2] / "examples" / "long-context.config.yaml").read_text()
    config = AppConfig(**yaml.safe_load(text)["applications"][0]["args"]).engine_config()
    assert (config.model.model, config.sparse.enabled, config.kvtier.enabled) == ("qwen2.5-coder-0.5b", True, True)
    assert _counts(config.sparse.for_context(32768)) == (256, 1792, 8192, 16384)
