"""The cluster KV tier behind the real Serve app: a cold replica resumes another replica's conversation.

Two applications, one replica each, share the tier (the embedded PostgreSQL the replicas start, as
`kvtier.dsn` unset does in production): turn 1 is served by one, turn 2 by the other, which loads the
history's blocks and says so in `usage.prompt_tokens_details.cached_tokens`. Once per engine: on
`engine: vllm` the tier is vLLM's KV connector.
"""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build
from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database

# ~2.2K tokens: on vLLM's 128-token pages the reusable full blocks are over 90% of turn 2's prompt.
HISTORY = " ".join(f"Entry {i}: the {c} lamp on shelf {i * 3} was moved to room {i * 11}." for i, c in enumerate(
    ["red", "green", "blue", "amber", "white", "black"] * 18
))  # fmt: skip
ENGINES = [
    "rayapp",
    pytest.param(
        "vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
    ),
]


@pytest.fixture(scope="module", params=ENGINES)
def config(request, tmp_path_factory) -> AppConfig:
    tier = {"enabled": True, "data_dir": f"{tmp_path_factory.mktemp('kvtier-serve')}/db"}
    if request.param == "vllm":
        return AppConfig(
            engine="vllm", dtype="float32", kv_cache_memory_gb=0.5, num_cpus=0.5, kvtier=tier,
            engine_kwargs={"enforce_eager": True},
        )  # fmt: skip
    return AppConfig(dtype="float32", kv_cache_memory_gb=0.25, num_cpus=0.5, kvtier=tier)


@pytest.fixture(scope="module")
def base_url(config, serve_app):
    with serve_app(config, {app: f"/{app}" for app in ("tier-a", "tier-b")}) as url:
        try:
            yield url
        finally:
            stop_embedded_database()  # through its Ray actor: before Ray goes down


def _wait_for_tier(config: AppConfig, app: str, prompt_tokens: int) -> None:
    """Until the tier holds the full blocks of a prompt `app` served: rayapp replicas flush their writer; a vLLM
    replica's writer is in vLLM's worker process, so the catalog is watched (bounded)."""
    serve.get_deployment_handle("LLMReplica", app_name=app).flush_tier.remote().result()
    catalog = Catalog(start_embedded_database(config.kvtier.data_dir), 3 * 64)
    deadline = time.monotonic() + 60
    while catalog.usage().num_blocks < prompt_tokens // config.kv_block_size():
        assert time.monotonic() < deadline, "turn 1's blocks never reached the tier"
        time.sleep(0.1)
    catalog.close()


def _chat(base_url: str, app: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{base_url}/{app}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_cold_replica_serves_turn_two_from_the_tier(config, base_url):
    messages = [{"role": "user", "content": f"{HISTORY}\nWhere did the amber lamp go first?"}]
    first = _chat(base_url, "tier-a", messages)
    _wait_for_tier(config, "tier-a", first["usage"]["prompt_tokens"])
    # The writer's own counters reach the replica's stats (and /metrics), from vLLM's worker process too.
    written = serve.get_deployment_handle("LLMReplica", app_name="tier-a").stats.remote().result()
    assert written["tier_written_blocks"] >= first["usage"]["prompt_tokens"] // config.kv_block_size()
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the white one?"},
    ]
    second = _chat(base_url, "tier-b", messages)
    usage = second["usage"]
    assert usage["prompt_tokens"] > 2048
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
    stats = serve.get_deployment_handle("LLMReplica", app_name="tier-b").stats.remote().result()
    assert stats["tier_loaded_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    # Served again by the replica that wrote turn 1, from its own cache: the same greedy answer.
    again = _chat(base_url, "tier-a", messages)
    assert again["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    _upgraded_replica_refills_from_the_tier(config, base_url, messages, second)


def _upgraded_replica_refills_from_the_tier(config: AppConfig, base_url: str, messages: list, second: dict) -> None:
    """A rolling upgrade of tier-a (a changed max_num_seqs) starts a replica with an empty cache: it loads the
    conversation's history from the tier instead of computing it, and answers as before."""
    serve.run(build(config.model_copy(update={"max_num_seqs": 32}), app_name="tier-a"), name="tier-a",
              route_prefix="/tier-a")  # fmt: skip
    again = _chat(base_url, "tier-a", messages)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * again["usage"]["prompt_tokens"]
    stats = serve.get_deployment_handle("LLMReplica", app_name="tier-a").stats.remote().result()
    assert stats["tier_loaded_tokens"] == cached
    assert again["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
