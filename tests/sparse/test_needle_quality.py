"""Needle in a haystack on SmolLM2: sparse decode with RetrievalKV settings scaled to its 8K context, and
layer-wise compression at its default settings, find the fact about as often as dense decode does.

Each prompt is prefilled once: the dense and sparse runs share it through the prefix cache (only
the last `scoring_queries` prompt tokens are recomputed), so the test costs about one prefill per
case (~1.5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import dataclasses

import pytest

from rayapp import LLM, SamplingParams
from rayapp.config import LayerwiseConfig, SparseConfig
from rayapp.sparse.evaluation import SCALED_SPARSE, needle_case

pytestmark = pytest.mark.slow  # the real model over long prompts

SCALED = SparseConfig(**SCALED_SPARSE, topk_percent=0.2, device_cache_blocks=64)
LENGTHS = [1200, 1900, 2600, 3300, 4000, 4700, 5400, 6000]
DEPTHS = [0.15, 0.5, 0.85, 0.3, 0.65, 0.1, 0.45, 0.75]


def test_sparse_finds_the_needle_within_one_case_of_dense(tokenizer):
    # Built sparse, so the device block cache for offloaded cases exists; each run picks its settings.
    llm = LLM(max_num_batched_tokens=2048, sparse=SCALED)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    dense_found = sparse_found = offloaded = 0
    for i, (n, depth) in enumerate(zip(LENGTHS, DEPTHS)):
        case = needle_case(tokenizer, n, depth, seed=100 + i)
        llm.engine.reconfigure(sparse=dataclasses.replace(SCALED, enabled=False))
        dense_found += case.found(
            llm.generate(prompt_token_ids=case.prompt_token_ids, sampling_params=params)[0].outputs[0].text
        )
        llm.engine.reconfigure(sparse=SCALED)
        out = llm.generate(prompt_token_ids=case.prompt_token_ids, sampling_params=params)[0]
        sparse_found += case.found(out.outputs[0].text)
        offloaded += llm.stats()["sparse_seqs_offload"]  # counters restart with each reconfigure
    # Cases from 2049 tokens on run with their middle in the host pool.
    assert offloaded == sum(n > 2100 for n in LENGTHS)
    assert dense_found >= len(LENGTHS) - 2, f"dense found only {dense_found}: the cases are too hard to judge by"
    assert sparse_found >= dense_found - 1, f"sparse found {sparse_found}, dense {dense_found} of {len(LENGTHS)}"


def test_layerwise_compression_at_its_defaults_finds_the_needle_at_4x_within_one_case_of_dense(tokenizer):
    # Seeds from 300: the default kernel_size was chosen with bench/layerwise.py on seeds 100 and up.
    lengths = [1000, 1400, 1800, 2200, 2600, 3000, 3400, 4000]
    cases = [needle_case(tokenizer, n, depth, seed=300 + i) for i, (n, depth) in enumerate(zip(lengths, DEPTHS))]
    defaults = LayerwiseConfig(enabled=True)
    assert defaults.compression_ratio == 4
    llm = LLM(max_num_batched_tokens=2048, kv_cache_memory_gb=4.0)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    found = {}
    for name, config in (("dense", LayerwiseConfig()), ("layerwise", defaults)):
        llm.engine.reconfigure(layerwise=config)  # each prompt is prefilled once: the second run hits its pages
        outputs = llm.generate(prompt_token_ids=[c.prompt_token_ids for c in cases], sampling_params=params)
        found[name] = sum(c.found(o.outputs[0].text) for c, o in zip(cases, outputs))
    assert llm.stats()["layerwise_compacted_seqs"] == len(cases)  # counters restart with reconfigure
    assert found["dense"] >= len(cases) - 2, f"dense found only {found['dense']}: the cases are too hard to judge by"
    assert found["layerwise"] >= found["dense"] - 1, f"found {found} of {len(cases)}"
