"""A rolling upgrade while conversations stream: `serve.run` of a changed config (what `serve deploy` does) replaces
the ingress and the replicas, and no client notices. Served over the scripted backend, whose answers are a function
of the prompt, so an answer that moved to a new replica halfway is checked whole against a fresh one."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from ray import serve
from scripted import ScriptedBackend
from served import MODEL, stream_chat

from rayapp.config import AppConfig
from rayapp.deployments.builder import build

# The old replicas drain for 5 s: the answers still running then move to the new ones and go on there.
BEFORE = AppConfig(replicas=2, num_cpus=0.5, max_num_seqs=64, graceful_shutdown_timeout_s=5)
AFTER = BEFORE.model_copy(update={"max_num_seqs": 32, "max_model_len": 4096})
# Streams of 500 tokens at the scripted 20 tokens/s: 25 s, longer than the replicas' drain and than Serve's default
# graceful shutdown (20 s), which the replaced ingress would otherwise get.
STREAM_TOKENS = 500


@pytest.fixture(scope="module")
def base_url(serve_app):
    with serve_app(BEFORE, backend_cls=ScriptedBackend) as url:
        yield url


def _body(i: int, long: bool) -> dict:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": STREAM_TOKENS if long else 8,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Tell me about river number {i}."}],
    }


def test_streams_in_flight_complete_through_an_upgrade(base_url):
    upgraded = threading.Event()

    def upgrade() -> None:
        serve.run(build(AFTER, ScriptedBackend), name="rayapp", route_prefix="/")
        upgraded.set()

    async def load() -> tuple[list, list[int], list[dict]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
            streams = [asyncio.create_task(stream_chat(http, _body(i, long=True))) for i in range(8)]
            await asyncio.sleep(3)  # every stream is answering
            rolling = asyncio.create_task(asyncio.to_thread(upgrade))
            statuses = []
            while not upgraded.is_set():  # new requests keep coming while the old replicas drain
                response = await http.post("/v1/chat/completions", json=_body(100 + len(statuses), long=False))
                statuses.append(response.status_code)
                await asyncio.sleep(0.5)
            await rolling
            results = await asyncio.gather(*streams)
            # The same requests, answered whole by the new replicas.
            whole = [http.post("/v1/chat/completions", json=_body(i, long=True)) for i in range(8)]
            return results, statuses, [r.json() for r in await asyncio.gather(*whole)]

    results, statuses, references = asyncio.run(load())
    assert statuses and set(statuses) == {200}, statuses
    for i, ((text, finish, done), reference) in enumerate(zip(results, references, strict=True)):
        assert done and finish == "length", (i, finish, done)
        assert text == reference["choices"][0]["message"]["content"]
    # The new config serves: its context length is what /v1/models says.
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 4096
