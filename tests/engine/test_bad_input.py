"""Bad input gets a ValueError that names the field and what to change; aborts free every page."""

from __future__ import annotations

import asyncio
import json

import pytest

from rayapp import LLM, AsyncLLMEngine, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=256, num_pages=64)


def test_empty_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]])


def test_prompt_longer_than_max_model_len_is_rejected_with_the_limit(llm):
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate(prompt_token_ids=[1] * 300)


def test_prompt_that_cannot_fit_the_page_pool_is_rejected():
    llm = LLM(dtype="float32", num_pages=4)
    with pytest.raises(ValueError, match="num_pages"):
        llm.generate(prompt_token_ids=[1] * 60, sampling_params=SamplingParams(max_tokens=16))


def test_out_of_vocabulary_token_ids_are_rejected(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[1, 10**7])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_sampling_params_out_of_range_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="model="):
        LLM(model=str(tmp_path / "no-such-model"))


def test_unsupported_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_unknown_engine_option_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="block_size"):
        LLM(blok_size=16)


def test_nothing_is_queued_when_one_prompt_of_a_batch_is_bad(llm):
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[1, 2, 3], []])
    assert not llm.engine.has_unfinished_requests()


def test_abort_mid_generation_frees_every_page():
    engine = LLMEngine.from_options(dtype="float32", num_pages=64)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    engine.add_request(engine.request("a", "Tell me a long story about the sea.", params))
    while not engine.step():
        pass
    assert engine.stats()["pages_used"] > 0
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.stats()["pages_used"] == 0
    assert not engine.has_unfinished_requests()


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_pages():
    engine = AsyncLLMEngine.from_options(dtype="float32", num_pages=64)

    async def scenario() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate(engine.engine.request("s", "Count to one hundred.", params))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        await engine.abort("s")  # queued after the stream's own abort: returns once both ran

    try:
        asyncio.run(scenario())
        assert asyncio.run(engine.stats())["pages_used"] == 0
    finally:
        engine.shutdown()
