"""A Ray Serve LLM config served by rayapp's builder: Ray's OpenAI ingress and LLMServer on vLLM, two replicas,
rayapp's router fed by their vLLM KV events. Later turns of each conversation must land on the replica holding
the earlier ones, judged by what vLLM delivers (`usage.prompt_tokens_details.cached_tokens`, which Ray's ingress
passes through), not by what the router claims.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from ray import serve  # noqa: E402

from rayapp.integrations.ray_serve_llm import build_openai_app  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"  # the model_id of conftest.serve_llm_args
BLOCK = 128  # vLLM's default page size on CPU, which the builder pins
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}
TOPICS = ["rivers", "volcanoes", "owls"]


@pytest.fixture(scope="module")
def base_url(serve_llm_args, free_port):
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(serve_llm_args()), name="serve-llm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _opening(topic: str) -> dict[str, str]:
    # Long and distinct per conversation: its pages, not the shared system prompt's, decide the hit.
    facts = " ".join(f"Note {i}: {topic} are interesting for reason number {i}." for i in range(30))
    return {"role": "user", "content": f"I am studying {topic}. {facts} Tell me one thing about {topic}."}


async def _conversation(client: httpx.AsyncClient, topic: str, turns: int) -> list[tuple[int, int]]:
    """Each turn's (prompt tokens of the turn before, cached tokens delivered)."""
    messages = [SYSTEM, _opening(topic)]
    results, previous_prompt = [], 0
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        results.append((previous_prompt, data["usage"]["prompt_tokens_details"]["cached_tokens"]))
        previous_prompt = data["usage"]["prompt_tokens"]
        answer = data["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"More, {turn}."}]
    return results


def test_later_turns_land_on_the_replica_holding_the_conversation(base_url):
    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            return await asyncio.gather(*(_conversation(client, topic, 3) for topic in TOPICS))

    conversations = asyncio.run(run())
    later_turns = [turn for conversation in conversations for turn in conversation[1:]]
    # On the holder, a turn finds at least the turn before's whole prompt cached (its full pages); on the other
    # replica it finds none of the conversation's own pages. By chance (load-only routing) all 6 would hit 1 in 64.
    assert all(cached >= previous - previous % BLOCK for previous, cached in later_turns), later_turns
