"""An answer whose replica dies mid-stream continues on another with exactly the text it would have had.

The ingress' `Generation` runs over a replica handle whose first stream dies (RayActorError, as Serve
raises when a replica process is gone) after some deltas; the streams come from real engine backends
(rayapp's, and vLLM's where it is installed). Greedy, so the uninterrupted answer is the reference.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import uuid

import pytest
from ray.exceptions import RayActorError

from rayapp.blocks import BlockHash, hash_blocks
from rayapp.config import AppConfig
from rayapp.deployments.engines import backend_class
from rayapp.deployments.generation import Generation, InFlight
from rayapp.engine.request import EngineRequest
from rayapp.engine.sampling_params import SamplingParams
from rayapp.models.tokenizer import chat_token_ids

pytestmark = pytest.mark.slow  # real engine backends (rayapp's process, vLLM's AsyncLLM)

MESSAGES = [{"role": "user", "content": "List the planets of the solar system, one per line, with a short note."}]
CONFIGS = {
    "rayapp": AppConfig(dtype="float32", kv_cache_memory_gb=0.25),
    "vllm": AppConfig(engine="vllm", dtype="float32", kv_cache_memory_gb=0.5, engine_kwargs={"enforce_eager": True}),
}
ENGINES = [
    "rayapp",
    pytest.param(
        "vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
    ),
]


class _Stream:
    """One replica stream: the backend's deltas, dying with RayActorError after `die_after` of them."""

    def __init__(self, deltas, die_after: int | None) -> None:
        self.deltas, self.die_after, self.sent = deltas, die_after, 0

    async def __anext__(self):
        if self.sent == self.die_after:
            await self.deltas.aclose()
            raise RayActorError()
        self.sent += 1
        return await self.deltas.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.deltas.aclose())


def _hash_blocks(block_size: int, ids: list[int], salt: str) -> list[BlockHash]:
    return hash_blocks(ids, block_size, ("SmolLM2-135M-Instruct", salt))


class _Replica:
    """A replica handle whose first stream dies."""

    def __init__(self, backend, die_after: int | None) -> None:
        self.backend, self.die_after = backend, die_after

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        die_after, self.die_after = self.die_after, None
        return _Stream(self.backend.generate(request), die_after)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    """(backend, config, loop): every test runs on `loop`, since vLLM's AsyncLLM stays on the loop it first ran on."""
    config = CONFIGS[request.param]
    loop = asyncio.new_event_loop()
    environment = dict(os.environ)
    backend = backend_class(config).from_app_config(config)
    # What the backend set for its replica's process (vLLM's on CPU: one engine process) stays out of later tests.
    os.environ.clear()
    os.environ.update(environment)
    yield backend, config, loop

    async def shutdown() -> None:  # on its loop: vLLM's AsyncLLM closes its sockets at once there
        backend.shutdown()

    loop.run_until_complete(shutdown())
    loop.close()


async def _generate(engine, ids, sampling, die_after):
    backend, config, _ = engine
    hasher = functools.partial(_hash_blocks, config.kv_block_size())
    inflight = InFlight()
    request = EngineRequest(uuid.uuid4().hex, ids, hasher(ids, ""), "", sampling, MESSAGES)
    generation = Generation(_Replica(backend, die_after), request, hasher, inflight)
    items = [await generation.next()]
    while not items[-1].last:
        items.append(await generation.next())
    generation.release(cancel=False)
    assert inflight.moved == (die_after is not None) and inflight.requests == 0
    return generation, items


async def _answer(engine, ids, sampling, die_after):
    generation, items = await _generate(engine, ids, sampling, die_after)
    return "".join(i.text for i in items), items[-1].finish_reason, len(generation.answers[0].generated)


def test_a_moved_answer_is_the_uninterrupted_answer_byte_for_byte(engine, tokenizer):
    ids = chat_token_ids(tokenizer, MESSAGES)
    free = SamplingParams(temperature=0, max_tokens=48)

    async def check():
        whole, _, _ = await _answer(engine, ids, free, None)
        # A stop string that spans many cuts: ten characters from the middle of the uninterrupted answer.
        stop = whole[20:30]
        stopped_at = SamplingParams(temperature=0, max_tokens=48, stop=(stop,))
        stopped, reason, consumed = await _answer(engine, ids, stopped_at, None)
        assert reason == "stop" and stopped == whole[: whole.find(stop)]
        for cut in range(1, consumed):
            assert (await _answer(engine, ids, free, cut))[0] == whole, cut
            assert (await _answer(engine, ids, stopped_at, cut))[:2] == (stopped, "stop"), cut

    engine[2].run_until_complete(check())


def test_each_unfinished_answer_of_a_request_moves_and_finishes(engine, tokenizer):
    ids = chat_token_ids(tokenizer, MESSAGES)
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True, n=3)
    generation, items = engine[2].run_until_complete(_generate(engine, ids, sampled, 5))
    assert [len(a.generated) for a in generation.answers] == [24, 24, 24]
    assert items[-1].usage.completion_tokens == 72 and items[-1].usage.prompt_tokens == len(ids)
    for k, answer in enumerate(generation.answers):
        # What was streamed before the cut and after it reads as the answer's tokens do.
        text = "".join(i.text for i in items if i.index == k)
        assert text == tokenizer.decode(answer.generated, skip_special_tokens=True)
        assert [i.finish_reason for i in items if i.index == k and i.finished] == ["length"]


def test_a_moved_answer_keeps_what_is_left_of_min_tokens(engine, tokenizer):
    ids = chat_token_ids(tokenizer, MESSAGES)
    # EOS (id 2) would be every token; min_tokens holds it back for 10, counted across the move.
    held = SamplingParams(temperature=0, max_tokens=12, min_tokens=10, logit_bias={2: 100.0})

    async def check():
        whole, reason, consumed = await _answer(engine, ids, held, None)
        assert reason == "stop" and consumed == 11
        for cut in range(1, consumed):
            assert (await _answer(engine, ids, held, cut)) == (whole, "stop", 11), cut

    engine[2].run_until_complete(check())
