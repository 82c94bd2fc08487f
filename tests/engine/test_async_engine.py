"""AsyncLLMEngine: concurrent streams join and leave the running batch at step boundaries."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rayapp import LLM, AsyncLLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLMEngine.from_options(dtype="float32", num_pages=256)
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncLLMEngine, request_id: str, prompt: str, params: SamplingParams):
    deltas, last = [], None
    async for out in engine.generate(engine.engine.request(request_id, prompt, params)):
        deltas.append(out.outputs[0].delta_text)
        last = out
    return "".join(deltas), last


def test_concurrent_streams_deliver_exact_deltas_and_match_offline_greedy(engine):
    prompts = ["Le café est", "The quick brown fox", "東京は日本の", "Once upon a time 🚀"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def scenario():
        return await asyncio.gather(*(_collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))

    results = asyncio.run(scenario())
    for joined, last in results:
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert joined == last.outputs[0].text and "\ufffd" not in joined
        assert len(last.outputs[0].token_ids) == 24
        assert last.metrics.time_to_first_token is not None
    offline = LLM(dtype="float32", num_pages=256).generate(prompts, params)
    assert [r[1].outputs[0].token_ids for r in results] == [o.outputs[0].token_ids for o in offline]
    assert asyncio.run(engine.stats())["pages_used"] == 0


def test_stats_are_read_on_the_engine_thread_while_it_steps(engine, monkeypatch):
    """The step loop mutates the scheduler and the page pool: stats taken between two steps are consistent."""
    threads = []
    read = engine.engine.stats
    monkeypatch.setattr(engine.engine, "stats", lambda: threads.append(threading.current_thread().name) or read())
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    async def scenario():
        stream = asyncio.ensure_future(_collect(engine, "busy", "Tell me about the sea.", params))
        during = await engine.stats()
        await stream
        return during

    during = asyncio.run(scenario())
    assert threads == ["rayapp-engine"] and during["num_requests"] >= 1


def test_stats_count_the_steps_and_their_wall_and_cpu_time(engine):
    before = asyncio.run(engine.stats())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    asyncio.run(_collect(engine, "timed", "Count to five.", params))
    after = asyncio.run(engine.stats())
    steps = after["engine_steps"] - before["engine_steps"]
    wall = after["engine_step_seconds"] - before["engine_step_seconds"]
    cpu = after["engine_step_cpu_seconds"] - before["engine_step_cpu_seconds"]
    assert steps >= 12  # the prompt's step, then one per token after the first
    assert 0 < cpu <= wall  # one thread's CPU time cannot pass its wall time


def test_stop_string_ends_the_stream_and_is_cut_from_the_text(engine):
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def scenario():
        _, free_run = await _collect(engine, "free", "Count: 1, 2, 3,", params)
        text = free_run.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, stop=[stop])
        joined, last = await _collect(engine, "stopped", "Count: 1, 2, 3,", stopped)
        return text, stop, joined, last

    text, stop, joined, last = asyncio.run(scenario())
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert joined == last.outputs[0].text == text[: text.index(stop)]


def test_bad_request_raises_before_anything_is_queued(engine):
    async def scenario():
        async for _ in engine.generate(engine.engine.request("bad", "")):
            pass

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(scenario())
    assert not engine.engine.has_unfinished_requests()
