"""Layer-wise KV compression behind the OpenAI endpoint: a real Serve app with `layerwise` on."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from rayapp import LLM, SamplingParams
from rayapp.config import AppConfig
from rayapp.sparse.evaluation import needle_case

MODEL = "SmolLM2-135M-Instruct"
LAYERWISE = {"enabled": True, "compression_ratio": 4, "kernel_size": 13}
CONFIG = AppConfig(dtype="float32", kv_cache_memory_gb=0.5, layerwise=LAYERWISE)


@pytest.fixture(scope="module")
def base_url(serve_app):
    with serve_app(CONFIG) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_a_long_conversation_is_compressed_and_its_next_turn_hits_the_prefix_cache(base_url, client):
    offline = LLM(dtype="float32", kv_cache_memory_gb=0.5, layerwise=LAYERWISE)
    case = needle_case(offline.get_tokenizer(), 900, 0.4, seed=7)
    messages = [{"role": "user", "content": case.text}]
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert case.answer in first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Repeat the code once more."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    # The first turn's dense prompt pages stayed in the prefix cache while its compressed copy decoded.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    assert second.choices[0].message.content == expected
    assert _metric(base_url, "rayapp_layerwise_compacted_seqs_total") >= 2


def _metric(base_url: str, name: str) -> float:
    """Sum of a replica series once the replicas' pushes (twice a second) report it non-zero."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{base_url}/metrics").text
        values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
        if values and sum(values):
            return sum(values)
        assert time.monotonic() < deadline, f"{name} not reported on /metrics"
        time.sleep(0.1)
