"""The cluster KV tier behind the real Serve app: a cold replica resumes another replica's conversation.

Two applications, one replica each, share the tier (the embedded PostgreSQL the replicas start, as
`kvtier.dsn` unset does in production): turn 1 is served by one, turn 2 by the other, which loads the
history's blocks and says so in `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import socket

import httpx
import pytest
import ray
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build
from rayapp.kvtier.embedded import stop_embedded_database

HISTORY = " ".join(f"Entry {i}: the {c} lamp on shelf {i * 3} was moved to room {i * 11}." for i, c in enumerate(
    ["red", "green", "blue", "amber", "white", "black"] * 5
))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    port = _free_port()
    data_dir = tmp_path_factory.mktemp("kvtier-serve")
    config = AppConfig(
        dtype="float32", kv_cache_memory_gb=0.25, num_cpus=0.5, kvtier={"enabled": True, "data_dir": f"{data_dir}/db"}
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for app in ("tier-a", "tier-b"):
        serve.run(build(config, app_name=app), name=app, route_prefix=f"/{app}")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    stop_embedded_database()
    ray.shutdown()


def _chat(base_url: str, app: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{base_url}/{app}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_cold_replica_serves_turn_two_from_the_tier(base_url):
    messages = [{"role": "user", "content": f"{HISTORY}\nWhere did the amber lamp go first?"}]
    first = _chat(base_url, "tier-a", messages)
    serve.get_deployment_handle("LLMReplica", app_name="tier-a").flush_tier.remote().result()
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the white one?"},
    ]
    second = _chat(base_url, "tier-b", messages)
    usage = second["usage"]
    assert usage["prompt_tokens"] > 500
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
    stats = serve.get_deployment_handle("LLMReplica", app_name="tier-b").stats.remote().result()
    assert stats["tier_loaded_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    # Served again by the replica that wrote turn 1, from its own cache: the same greedy answer.
    again = _chat(base_url, "tier-a", messages)
    assert again["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
