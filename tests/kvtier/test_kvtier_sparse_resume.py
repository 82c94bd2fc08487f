"""A long history resumed from the cluster tier by an engine whose sparse retrieval offloads: its middle goes
straight to the host pool, the device holds only the init pages and the window, and the answer is the one
a local sparse run of the same history gives.

Real embedded PostgreSQL and store actor, the shipped SmolLM2 in float32, SmolLM2's 8K context scaled down
from the 32K / 64K sparse defaults.
"""

from __future__ import annotations

import pytest
import ray

from rayapp import LLM, SamplingParams
from rayapp.engine.pages import OFFLOADED
from rayapp.engine.request import EngineRequest
from rayapp.kvtier.embedded import stop_embedded_database
from rayapp.sparse.evaluation import SCALED_SPARSE, needle_case

pytestmark = pytest.mark.slow  # a Ray cluster, the tier's database and long prompts

SPARSE = {**SCALED_SPARSE, "device_cache_blocks": 96, "scoring_queries": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def tier_options(tmp_path_factory):
    ray.init(address="local", num_cpus=2, object_store_memory=400 << 20, include_dashboard=False)
    yield {"enabled": True, "data_dir": str(tmp_path_factory.mktemp("kvtier-sparse") / "db")}
    stop_embedded_database()
    ray.shutdown()


@pytest.fixture(scope="module")
def history(tokenizer) -> list[int]:
    return needle_case(tokenizer, 4200, 0.4, seed=7).prompt_token_ids


@pytest.fixture(scope="module")
def local_answer(tier_options, history) -> list[int]:
    """A local sparse run's greedy answer to the history, whose blocks it wrote to the tier."""
    writer = LLM(dtype="float32", sparse=SPARSE, kvtier=tier_options)
    answer = writer.generate(prompt_token_ids=history, sampling_params=GREEDY)[0].outputs[0].token_ids
    assert writer.stats()["sparse_seqs_offload"] == 1
    writer.tier.flush()
    writer.close()
    return answer


def test_a_resumed_offload_history_keeps_its_middle_in_host_memory_and_answers_as_a_local_run(
    tier_options, history, local_answer
):
    llm = LLM(dtype="float32", sparse=SPARSE, kvtier=tier_options)
    engine = llm.engine
    request = engine.prepare_request(EngineRequest("resumed", history, sampling=GREEDY))
    engine.tier.load_now(request.seq)
    seq = request.seq
    policy = engine.extension("sparse").policy
    middle = policy.num_middle_blocks(len(history) + 1)
    host_pages = middle * policy.pages_per_block
    assert middle > 40 and seq.host_pages == range(policy.init_pages, policy.init_pages + host_pages)
    # Only the init pages and the window took device pages; the middle is in the host pool, represented.
    stats = llm.stats()
    assert stats["sparse_blocks_resumed_to_host"] == middle and stats["sparse_host_pages_held"] == host_pages
    table_pages = -(-len(history) // policy.block_size)
    assert stats["pages_cached"] <= table_pages - host_pages

    engine.enqueue(request)
    tokens: list[int] = []
    while not seq.output_token_ids:  # admission and the prefill of the uncached tail
        engine.step()
    assert seq.block_table.count(OFFLOADED) == host_pages
    stats = llm.stats()
    assert stats["pages_used"] == len(seq.block_table) - host_pages
    assert stats["sparse_blocks_offloaded"] == 0, "the middle never went through device pages"
    assert stats["tier_loaded_tokens"] >= 0.9 * len(history)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == local_answer
    stats = llm.stats()
    assert stats["sparse_cache_misses"] > 0  # decode copied its selected middle blocks in from the host pool
    assert stats["pages_used"] == 0 and stats["sparse_host_pages_held"] == 0
    engine.block_manager.check_invariants()
    llm.close()


def test_a_resumed_history_whose_init_pages_were_evicted_before_admission_is_recomputed_without_its_middle(
    tier_options, history, local_answer
):
    llm = LLM(dtype="float32", sparse=SPARSE, kvtier=tier_options)
    engine, bm = llm.engine, llm.engine.block_manager
    request = engine.prepare_request(EngineRequest("evicted", history, sampling=GREEDY))
    engine.tier.load_now(request.seq)
    seq = request.seq
    assert seq.host_pages
    hog = engine.prepare_request(EngineRequest("hog", [1], sampling=GREEDY)).seq
    assert bm.allocate(hog, bm.num_free_pages * bm.block_size)  # every free page, the loaded ones included
    bm.free(hog)
    engine.enqueue(request)
    while not seq.output_token_ids:  # the whole prompt is computed on the device
        engine.step()
    assert seq.num_cached_tokens == 0
    # After its prefill the middle's device pages went: the host pool already held that K/V.
    assert seq.block_table.count(OFFLOADED) == len(seq.host_pages)
    assert llm.stats()["sparse_blocks_offloaded"] == 0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == local_answer
    bm.check_invariants()
    llm.close()
