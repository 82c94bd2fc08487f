"""EngineProcess: rayapp's engine stepping in a child process, streamed back as GenerateDeltas."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from rayapp import LLM, SamplingParams
from rayapp.blocks import BlockStored
from rayapp.config import EngineConfig
from rayapp.drivers.backend import EngineDeadError
from rayapp.drivers.process import PROCESS_NAME, EngineProcess
from rayapp.engine.request import CONTEXT_LENGTH_EXCEEDED, EngineRequest, LimitError

OPTIONS = {"dtype": "float32", "num_pages": 128}
PROMPTS = [[1, 504, 3458, 282, 253, 2914], [1, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]


@pytest.fixture(scope="module")
def engine():
    engine = EngineProcess(EngineConfig.from_options(**OPTIONS))
    yield engine
    engine.shutdown()


def _request(request_id: str, ids: list[int], **sampling) -> EngineRequest:
    return EngineRequest(request_id, ids, [], "", SamplingParams(**sampling), ids)


async def _collect(engine: EngineProcess, request: EngineRequest):
    return [delta async for delta in engine.generate(request)]


def _engine_process(engine: EngineProcess) -> psutil.Process:
    (child,) = [p for p in psutil.Process().children() if p.pid == engine._process.pid]
    return child


def test_the_engine_steps_in_a_named_process_of_its_own(engine):
    child = _engine_process(engine)
    assert child.pid != os.getpid() and child.name() == PROCESS_NAME
    before = child.cpu_times().user
    asyncio.run(_collect(engine, _request("busy", PROMPTS[0], temperature=0.0, max_tokens=16, ignore_eos=True)))
    assert child.cpu_times().user > before  # the child computed the answer
    assert asyncio.run(engine.stats())["engine_steps"] >= 16


def test_concurrent_answers_equal_offline_greedy_with_usage_on_the_last_delta(engine):
    params = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}

    async def scenario():
        return await asyncio.gather(*(_collect(engine, _request(f"g{i}", p, **params)) for i, p in enumerate(PROMPTS)))

    streams = asyncio.run(scenario())
    offline = LLM(**OPTIONS).generate(sampling_params=SamplingParams(**params), prompt_token_ids=PROMPTS)
    for deltas, reference, prompt in zip(streams, offline, PROMPTS):
        assert [t for d in deltas for t in d.token_ids] == reference.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == reference.outputs[0].text
        assert [d.usage is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].usage.prompt_tokens == len(prompt) and deltas[-1].usage.completion_tokens == 20
        assert deltas[-1].finish_reason == "length"


def test_a_refused_request_raises_value_error_and_the_engine_serves_on(engine):
    with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, "):
        asyncio.run(_collect(engine, _request("bad", [10**9])))
    deltas = asyncio.run(_collect(engine, _request("after", PROMPTS[0], temperature=0.0, max_tokens=4)))
    assert deltas[-1].usage is not None


@pytest.mark.parametrize(
    ("ids", "max_tokens", "param", "code"),
    [
        (PROMPTS[0], 128 * 16, "max_tokens", None),  # past the pool: only the engine knows its size
        ([1] * 8192, None, "prompt", CONTEXT_LENGTH_EXCEEDED),
    ],
)
def test_a_limit_error_crosses_the_process_whole(engine, ids, max_tokens, param, code):
    """The ingress answers a LimitError's `param` and `code` in its 400: they must survive the pipe."""
    with pytest.raises(LimitError) as raised:
        asyncio.run(_collect(engine, _request("limit", ids, max_tokens=max_tokens)))
    assert (raised.value.param, raised.value.code) == (param, code)


def test_leaving_a_stream_early_aborts_it_and_frees_its_pages(engine):
    async def scenario():
        stream = engine.generate(_request("left", PROMPTS[1], temperature=0.0, max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        # The abort is queued before this call, and calls run in order on the engine's thread.
        return await engine.stats()

    stats = asyncio.run(scenario())
    assert stats["num_running"] == 0 and stats["pages_used"] == 0


def test_cached_blocks_lists_the_cache_and_leaves_its_events_pending(engine):
    async def scenario():
        await engine.take_kv_events()
        ids = list(range(100, 140))  # two full pages of a prompt no other test sends
        await _collect(engine, _request("cached", ids, temperature=0.0, max_tokens=4))
        cached = await engine.cached_blocks()
        pending = await engine.take_kv_events()
        snapshot = await engine.kv_snapshot()
        return cached, pending, snapshot

    cached, pending, snapshot = asyncio.run(scenario())
    stored = {h for e in pending if isinstance(e, BlockStored) for h in e.block_hashes}
    assert len(stored) >= 2 and stored <= set(cached)
    assert sorted(cached) == sorted(h for e in snapshot if isinstance(e, BlockStored) for h in e.block_hashes)


def test_a_killed_engine_process_fails_its_streams_and_reports_dead():
    engine = EngineProcess(EngineConfig.from_options(**OPTIONS))

    async def scenario():
        stream = engine.generate(_request("doomed", PROMPTS[0], temperature=0.0, max_tokens=500, ignore_eos=True))
        await anext(stream)
        _engine_process(engine).kill()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.stats()

    try:
        asyncio.run(scenario())
        assert not engine.is_running()
    finally:
        engine.shutdown()


def test_an_engine_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="did not start: .*max_model_len=999999"):
        EngineProcess(EngineConfig.from_options(dtype="float32", max_model_len=999_999))
