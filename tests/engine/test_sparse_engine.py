"""Sparse retrieval attention in the engine: dense below the boundary is untouched, offload moves
the middle to the host pool and frees device pages without changing what is attended."""

from __future__ import annotations

import math

import pytest

from rayapp import LLM, SamplingParams
from rayapp.engine.pages import OFFLOADED
from rayapp.engine.request import EngineRequest
from rayapp.sparse.evaluation import SCALED_SPARSE, needle_case

pytestmark = pytest.mark.slow  # the real model over long prompts

# SmolLM2's 8K context scaled down from the 32K / 64K defaults.
SCALED = {**SCALED_SPARSE, "device_cache_blocks": 96, "scoring_queries": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    sizes = {"short": 300, "medium": 700, "edge": 1000, "sparse": 1500, "offload": 2600}
    return {k: needle_case(tokenizer, n, 0.3, seed=i).prompt_token_ids for i, (k, n) in enumerate(sizes.items())}


def test_prompts_below_dense_boundary_decode_exactly_as_with_sparse_disabled(prompts):
    batch = [prompts["short"], prompts["medium"], prompts["edge"], prompts["sparse"]]
    assert len(prompts["edge"]) < SCALED["dense_boundary"] <= len(prompts["sparse"])
    dense = LLM(dtype="float32").generate(prompt_token_ids=batch, sampling_params=GREEDY)
    llm = LLM(dtype="float32", sparse=SCALED)
    mixed = llm.generate(prompt_token_ids=batch, sampling_params=GREEDY)  # one sparse sequence decodes alongside
    for d, m in zip(dense[:3], mixed[:3]):
        assert m.outputs[0].token_ids == d.outputs[0].token_ids
    stats = llm.stats()
    assert (stats["sparse_seqs_dense"], stats["sparse_seqs_sparse"], stats["sparse_seqs_offload"]) == (3, 1, 0)
    assert stats["sparse_selected_blocks"] > 0


def test_sparse_on_with_its_defaults_starts_at_a_quarter_of_the_engines_context(prompts):
    llm = LLM(dtype="float32", max_model_len=2048, sparse={"enabled": True})
    c = llm.engine.config.sparse
    assert (c.init_tokens, c.local_tokens, c.dense_boundary, c.offload_boundary) == (16, 112, 512, 1024)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt_token_ids=[prompts["short"], prompts["medium"]], sampling_params=params)
    stats = llm.stats()
    assert (stats["sparse_seqs_dense"], stats["sparse_seqs_sparse"], stats["sparse_seqs_offload"]) == (1, 1, 0)


def test_offload_moves_middle_pages_to_host_frees_device_pages_and_keeps_the_tokens(prompts):
    prompt = prompts["offload"]
    on_device = LLM(dtype="float32", sparse={**SCALED, "offload_boundary": 4096})
    expected = on_device.generate(prompt_token_ids=prompt, sampling_params=GREEDY)[0].outputs[0].token_ids
    # Again, from the prefix cache: the prompt's last scoring queries are recomputed, so the same blocks win.
    again = on_device.generate(prompt_token_ids=prompt, sampling_params=GREEDY)[0]
    assert (
        len(prompt) - SCALED["scoring_queries"] - 16
        < again.num_cached_tokens
        <= len(prompt) - SCALED["scoring_queries"]
    )
    assert again.outputs[0].token_ids == expected
    assert on_device.stats()["sparse_seqs_sparse"] == 2

    llm = LLM(dtype="float32", sparse=SCALED)
    engine = llm.engine
    engine.add_request(EngineRequest("long", prompt, sampling=GREEDY))
    seq = engine._requests["long"].seq
    while not seq.output_token_ids:  # prefill, then the middle moves out
        engine.step()
    policy = engine.extension("sparse").policy
    middle = policy.num_middle_blocks(seq.num_computed_tokens + 1)
    offloaded = seq.block_table.count(OFFLOADED)
    assert middle > 10 and offloaded == middle * policy.pages_per_block
    stats = llm.stats()
    assert stats["pages_used"] == len(seq.block_table) - offloaded
    assert stats["sparse_host_pages_held"] == offloaded and stats["sparse_running_offload"] == 1
    tokens = list(seq.output_token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    # Same pages selected, same K/V (copied out and back in): the same tokens as on device.
    assert tokens == expected
    stats = llm.stats()
    assert stats["sparse_cache_misses"] > 0 and stats["sparse_cache_hits"] > stats["sparse_cache_misses"]
    assert stats["pages_used"] == 0 and stats["sparse_host_pages_held"] == 0
    engine.block_manager.check_invariants()


def test_preempted_offload_sequence_is_recomputed_and_releases_everything(prompts):
    # Room for one long sequence at a time: the second preempts or waits, both must finish.
    llm = LLM(dtype="float32", sparse=SCALED, num_pages=len(prompts["offload"]) // 16 + 12)
    outs = llm.generate(prompt_token_ids=[prompts["offload"], prompts["sparse"]], sampling_params=GREEDY)
    assert all(o.finished for o in outs)
    stats = llm.stats()
    assert stats["pages_used"] == 0 and stats["sparse_host_pages_held"] == 0
    llm.engine.block_manager.check_invariants()


def test_an_unset_device_block_cache_holds_what_the_offloaded_sequences_that_fit_select(prompts):
    sparse = {k: v for k, v in SCALED.items() if k != "device_cache_blocks"}
    llm = LLM(dtype="float32", sparse=sparse, num_pages=200, max_model_len=4096)
    # 200 pages hold 5 offloaded sequences (4 init, 32 window and 4 filling pages each); each selects the top
    # 20% of the 55 middle blocks of a 4096-token context, per layer and KV head.
    assert llm.engine.extension("sparse").num_cache_blocks == 5 * math.ceil(0.2 * 55)
    two = [prompts["offload"], prompts["offload"][40:]]
    outputs = llm.generate(prompt_token_ids=two, sampling_params=GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [16, 16]
    assert llm.stats()["sparse_seqs_offload"] == 2
