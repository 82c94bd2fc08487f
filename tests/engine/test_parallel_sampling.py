"""n > 1: one prompt computed once, forked into n answers that share its pages.

Answer i of a seeded request is the answer of the same request with n=1 and seed + i (as vLLM's are),
whether it was forked off the first answer's pages or, with no room in the batch, queued and served
from the prefix cache.
"""

from __future__ import annotations

import dataclasses

import pytest

from rayapp import LLM, SamplingParams
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.request import EngineRequest

# 100 tokens: six full pages of 16 and a partial one, and the fork point (token 99) is inside a page too.
PROMPT = list(range(1000, 1100))


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_pages=128)


def _singles(llm: LLM, params: SamplingParams, n: int) -> list[list[int]]:
    """Answer i of `params` asked alone, with n=1 and seed + i."""
    runs = [dataclasses.replace(params, n=1, seed=params.seed + i) for i in range(n)]
    return [llm.generate(prompt_token_ids=PROMPT, sampling_params=p)[0].outputs[0].token_ids for p in runs]


def test_seeded_answers_equal_their_single_seeded_runs(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, n=3)
    out = llm.generate(prompt_token_ids=PROMPT, sampling_params=params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in out.outputs)
    assert [c.token_ids for c in out.outputs] == _singles(llm, params, 3)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_answers_share_the_prompt_pages_and_abort_frees_them_all():
    engine = LLMEngine.from_options(dtype="float32", num_pages=64, enable_prefix_caching=False)
    bm, bs = engine.block_manager, engine.block_manager.block_size
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, n=3)
    engine.add_request(EngineRequest("r", PROMPT, sampling=sampling))
    while len(engine.scheduler.running) < 3:
        engine.step()
    engine.step()  # every answer has sampled its first token
    tables = [s.block_table for s in engine.scheduler.running]
    shared = (len(PROMPT) - 1) // bs
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert all(bm.page_info(p).ref_count == 3 for p in tables[0][:shared])
    # One prompt's pages, and each answer's own last page: without prefix caching nothing else is held.
    assert bm.num_used_pages == shared + 3
    final = engine.abort_request("r")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert bm.num_used_pages == 0 and not engine.has_unfinished_requests()


def test_answers_that_find_the_batch_full_queue_and_reuse_the_cached_prompt():
    llm = LLM(dtype="float32", num_pages=128, max_num_seqs=1)
    engine, bs = llm.engine, llm.engine.block_manager.block_size
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, n=3)
    engine.add_request(EngineRequest("q", PROMPT, sampling=params))
    answers, cached = {}, {}
    while engine.has_unfinished_requests():
        for seq in engine.scheduler.running:
            cached.setdefault(seq.seq_id, seq.num_cached_tokens)
        for out in engine.step():
            answers[out.outputs[0].index] = out.outputs[0]
    assert [answers[i].token_ids for i in range(3)] == _singles(llm, params, 3)
    # The prompt was computed once: the queued answers found its full pages in the prefix cache.
    assert cached == {"q": 0, "q#1": len(PROMPT) // bs * bs, "q#2": len(PROMPT) // bs * bs}


def test_a_moved_answer_must_be_a_single_one(llm):
    with pytest.raises(ValueError, match="n=1"):
        llm.engine.prepare_request(EngineRequest("moved", PROMPT, sampling=SamplingParams(n=2), delivered_tokens=4))
