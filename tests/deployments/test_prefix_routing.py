"""Two replicas behind the PrefixAwareRouter, on this machine: turns land where their prefix is, and a
replica killed mid-run costs no request. The replicas run the scripted backend (`scripted.ScriptedBackend`),
which keeps a real prefix cache and sends its KV events as the engines do; that each engine's own events feed
the router is checked where the engines are served (`test_serve_app.py`, and vLLM's under Ray Serve LLM in
`tests/integrations/test_ray_serve_llm_app.py`).

Routing is judged by what the replicas deliver (`usage.prompt_tokens_details.cached_tokens`), not
by what the router claims.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import ray
from scripted import ScriptedBackend

from rayapp.config import AppConfig
from rayapp.prefix_router.actor import prefix_index

MODEL = "SmolLM2-135M-Instruct"
SETTINGS = {"replicas": 2, "num_cpus": 0.5}
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}
TOPICS = ["rivers", "volcanoes", "bridges", "owls", "glaciers", "violins"]


@pytest.fixture(scope="module")
def config() -> AppConfig:
    return AppConfig(**SETTINGS)


@pytest.fixture(scope="module")
def base_url(serve_app, config):
    with serve_app(config, backend_cls=ScriptedBackend) as url:
        yield url


def _opening(topic: str) -> dict[str, str]:
    # Long and distinct per conversation: its pages, not the shared system prompt's, decide the hit.
    facts = " ".join(f"Note {i}: {topic} are interesting for reason number {i}." for i in range(30))
    return {"role": "user", "content": f"I am studying {topic}. {facts} Tell me one thing about {topic}."}


async def _chat(
    client: httpx.AsyncClient, messages: list[dict[str, str]], stream: bool, max_tokens: int, **extra: object
) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        return {"text": data["choices"][0]["message"]["content"], "usage": data["usage"]}
    body["stream_options"] = {"include_usage": True}
    text, usage = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                assert chunk["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage is not None
    return {"text": "".join(text), "usage": usage}


async def _conversation(
    client: httpx.AsyncClient, topic: str, turns: int, stream: bool, max_tokens: int, **extra: object
) -> list:
    """Each turn's (prompt tokens of the turn before, cached tokens delivered)."""
    messages = [SYSTEM, _opening(topic)]
    results, previous_prompt = [], 0
    for turn in range(turns):
        answer = await _chat(client, messages, stream, max_tokens, **extra)
        assert answer["usage"]["completion_tokens"] == max_tokens or not extra.get("ignore_eos")
        results.append((previous_prompt, answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
        previous_prompt = answer["usage"]["prompt_tokens"]
        messages += [{"role": "assistant", "content": answer["text"]}, {"role": "user", "content": f"More, {turn}."}]
    return results


def _replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "LLMReplica" in a["name"]]


def test_each_turn_lands_on_the_replica_holding_its_conversation(base_url, config):
    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            return await asyncio.gather(*(_conversation(client, t, 5, False, 8) for t in TOPICS))

    conversations = asyncio.run(run())
    later_turns = [turn for conversation in conversations for turn in conversation[1:]]
    # Routed to the holder, a turn finds at least the previous turn's whole prompt cached (its full
    # blocks); elsewhere it would find only the shared system prompt's blocks.
    block = config.kv_block_size()
    hits = [cached >= previous - previous % block for previous, cached in later_turns]
    assert sum(hits) >= 0.95 * len(hits), later_turns
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'rayapp_router_decisions_total{reason="overlap"}' in metrics
    predicted = re.search(r"^rayapp_router_predicted_cached_tokens_total (\S+)$", metrics, re.M)
    assert float(predicted.group(1)) > 0
    assert "rayapp_prefix_index_replicas 2.0" in metrics


def _decisions(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {
        reason: float(n)
        for reason, n in re.findall(r'^rayapp_router_decisions_total{reason="(\w+)"} (\S+)$', text, re.M)
    }


def _decided(base_url: str, before: dict[str, float]) -> dict[str, float]:
    """The routing decisions made since `before`, once the router has pushed them (twice a second)."""
    deadline = time.monotonic() + 30
    while True:
        now = _decisions(base_url)
        delta = {r: now.get(r, 0) - before.get(r, 0) for r in now}
        if sum(delta.values()) > 0:
            return {r: n for r, n in delta.items() if n}
        assert time.monotonic() < deadline, "the router's decisions never reached /metrics"
        time.sleep(0.1)


def test_tenants_share_no_pages_and_are_not_routed_by_each_others_prompts(base_url, config):
    messages = [SYSTEM, _opening("lighthouses")]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=300) as client:
        before = _decisions(base_url)
        alice = client.post("/v1/chat/completions", json={**body, "user": "alice"}).json()
        _decided(base_url, before)
        before = _decisions(base_url)
        bob = client.post("/v1/chat/completions", json={**body, "user": "bob"}).json()
        # Nothing of alice's (not even the system prompt's pages) was a routing reason for bob.
        assert _decided(base_url, before) == {"fallback": 1}
        before = _decisions(base_url)
        alice_again = client.post("/v1/chat/completions", json={**body, "user": "alice"}).json()
        assert _decided(base_url, before) == {"overlap": 1}
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt = alice["usage"]["prompt_tokens"]
    block = config.kv_block_size()
    assert alice_again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // block * block


async def _busy_replica(client: httpx.AsyncClient, running: int) -> str:
    """The busiest replica once the engines report `running` requests in all (`num_running` on /metrics)."""
    deadline = time.monotonic() + 120
    while True:
        text = (await client.get("/metrics")).text
        load = {r: float(n) for r, n in re.findall(r'^rayapp_num_running{replica="(\w+)"} (\S+)$', text, re.M)}
        if sum(load.values()) >= running:
            return max(load, key=load.get)
        assert time.monotonic() < deadline, "no replica ever ran the requests"
        await asyncio.sleep(0.1)


def test_killed_replica_costs_no_request_and_leaves_the_index(base_url, config):
    index = prefix_index("rayapp", config.router)
    victim_id = ""

    async def run():
        nonlocal victim_id
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            talks = [asyncio.ensure_future(_conversation(client, t, 2, True, 64, ignore_eos=True)) for t in TOPICS]
            # Take a replica away while it streams answers.
            victim_id = await _busy_replica(client, running=len(TOPICS))
            assert victim_id in ray.get(index.replicas.remote())
            victim = next(name for name in _replica_actors() if name.endswith(f"#{victim_id}"))
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*talks), timeout=600)

    conversations = asyncio.run(run())
    assert len(conversations) == len(TOPICS)  # every request completed (failures raise above)
    moved = re.search(r"^rayapp_ingress_moved_requests_total (\S+)$", httpx.get(f"{base_url}/metrics").text, re.M)
    assert float(moved.group(1)) >= 1  # some were streaming on the victim and continued on the survivor
    deadline = time.monotonic() + 60
    while victim_id in ray.get(index.replicas.remote()):
        assert time.monotonic() < deadline, "the dead replica stayed in the PrefixIndex"
        time.sleep(0.2)


def test_a_restarted_index_is_rebuilt_from_replica_snapshots(base_url, config):
    index = prefix_index("rayapp", config.router)
    ray.kill(index, no_restart=False)
    deadline = time.monotonic() + 120
    # Replicas see their next batch refused (or failing) and resend everything they cache.
    while True:
        try:
            stats = ray.get(index.stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            stats = {"replicas": 0, "blocks": 0}
        if stats["replicas"] >= 1 and stats["blocks"] > 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    with httpx.Client(base_url=base_url, timeout=300) as client:
        body = {"model": MODEL, "messages": [SYSTEM, _opening("rivers")], "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
