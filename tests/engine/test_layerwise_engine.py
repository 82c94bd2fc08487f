"""Layer-wise KV compression in the engine: compaction, freed pages, prefix caching, dense equality."""

import dataclasses

import pytest
import torch

from rayapp import LLM, SamplingParams
from rayapp.config import AppConfig, EngineConfig, LayerwiseConfig, LayerwiseSettings, SparseConfig
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.pages import NULL_PAGE
from rayapp.engine.request import EngineRequest
from rayapp.layerwise.extension import LayerwiseKV
from rayapp.sparse.evaluation import needle_case

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
ON = LayerwiseConfig(enabled=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_batched_tokens=256, num_pages=256)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [
        needle_case(tok, n, depth, seed=i).prompt_token_ids for i, (n, depth) in enumerate([(700, 0.3), (420, 0.7)])
    ]


def generate(llm, prompts, layerwise, params=GREEDY):
    llm.engine.reconfigure(layerwise=layerwise)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    llm.engine.block_manager.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def test_compression_ratio_zero_decodes_exactly_like_dense(llm, prompts):
    dense = generate(llm, prompts, LayerwiseConfig())
    assert generate(llm, prompts, dataclasses.replace(ON, compression_ratio=0)) == dense
    # Every layer full: the same compaction into per-layer tables, nothing dropped.
    assert generate(llm, prompts, dataclasses.replace(ON, full_layers=30)) == dense
    assert llm.stats()["layerwise_compacted_seqs"] == len(prompts)


def test_compaction_keeps_exactly_the_selected_tokens(llm, prompts, monkeypatch):
    llm.engine.reconfigure(layerwise=ON)
    engine, runner = llm.engine, llm.engine.runner
    seen = {}
    compact = LayerwiseKV._compact

    def spy(self, seq, cap):  # the prompt's dense K and the selection, just before compaction
        seen.update(k=runner.pool.k.clone(), pages=list(seq.block_table), n=seq.num_computed_tokens, cap=cap)
        compact(self, seq, cap)

    monkeypatch.setattr(LayerwiseKV, "_compact", spy)
    engine.add_request(EngineRequest("kept", prompts[0], sampling=SamplingParams(max_tokens=4)))
    while "cap" not in seen:
        engine.step()
    n, cap, bs = seen["n"], seen["cap"], engine.block_manager.block_size
    state = engine.extension("layerwise")._compacted["kept"]
    pages = torch.tensor(seen["pages"][: -(-n // bs)])
    flat = runner.pool.slots()[0].flatten(0, 1)
    for layer in range(engine.spec.num_layers):
        keys = seen["k"][layer].index_select(0, pages).view(-1, *flat.shape[1:])[:n]
        kept = state.lens[layer]
        rows = (state.table[layer, : state.num_pages[layer]][:, None] * bs + torch.arange(bs)).view(-1)[:kept]
        if layer < ON.full_layers:
            assert kept == n and torch.equal(flat[rows], keys)
        else:
            sel = cap.selected[layer - ON.full_layers]  # [Hkv, budget], ascending per head
            assert kept == cap.budgets[layer - ON.full_layers] < n
            assert torch.equal(sel, sel.sort(dim=-1).values)
            expected = torch.stack([keys[sel[h], h] for h in range(keys.shape[1])], dim=1)
            assert torch.equal(flat[rows], expected)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_compacted_sequence_holds_carrier_pages_and_no_token_table(llm, prompts):
    llm.engine.reconfigure(layerwise=ON)
    engine = llm.engine
    engine.add_request(EngineRequest("carried", prompts[1], sampling=SamplingParams(max_tokens=8, ignore_eos=True)))
    seq = engine._requests["carried"].seq
    while not seq.compacted:
        engine.step()
    carriers = list(seq.carrier_pages)
    assert seq.block_table == [] and carriers and NULL_PAGE not in carriers
    while engine.has_unfinished_requests():  # decoding grows the per-layer tables, never the token table
        assert seq.block_table == []
        engine.step()
    assert (seq.carrier_pages, engine.block_manager.num_used_pages) == ([], 0)
    assert not engine.runner.pool.k[:, NULL_PAGE].any() and not engine.runner.pool.v[:, NULL_PAGE].any()


@pytest.mark.slow  # the real model through many steps
def test_pages_freed_by_compaction_let_more_sequences_run():
    # Each ~600-token prompt takes 38 pages densely; 70 pages hold one such sequence, or three compacted (~14 each).
    def peak_decoding(layerwise):
        engine = LLMEngine.from_options(dtype="float32", num_pages=70, max_num_batched_tokens=640, layerwise=layerwise)
        tok = engine.tokenizer
        for i in range(3):
            ids = needle_case(tok, 600, 0.5, seed=10 + i).prompt_token_ids
            engine.add_request(EngineRequest(str(i), ids, sampling=SamplingParams(max_tokens=40, ignore_eos=True)))
        peak, generated = 0, 0
        while engine.has_unfinished_requests():
            tokens = len(engine.step())  # one per sequence that decoded (or ended its prefill) this step
            peak, generated = max(peak, tokens), generated + tokens
            engine.block_manager.check_invariants()
        return peak, generated, engine.stats()

    dense_peak, dense_tokens, _ = peak_decoding(None)
    peak, tokens, stats = peak_decoding({"enabled": True, "compression_ratio": 4})
    assert dense_peak == 1 and peak == 3
    assert tokens == dense_tokens == 3 * 40
    assert stats["layerwise_compacted_seqs"] == 3 and stats["layerwise_pages_saved"] > 0
    assert stats["pages_used"] == 0  # every page, carriers included, came back


def test_full_layer_prefix_cache_entries_still_hit(llm, prompts):
    first = generate(llm, prompts[:1], ON)
    before = llm.stats()["cached_prompt_tokens"]
    again = generate(llm, prompts[:1], ON)
    cached = llm.stats()["cached_prompt_tokens"] - before
    # All but the observation window (recomputed for its scores), in whole blocks.
    assert cached >= len(prompts[0]) - ON.window - 16
    assert again == first  # the same dense prefix, the same selection


@pytest.mark.slow  # the real model through many steps
def test_a_preempted_compacted_sequence_resumes():
    engine = LLMEngine.from_options(
        dtype="float32", num_pages=40, max_num_batched_tokens=512, layerwise={"enabled": True}
    )
    tok = engine.tokenizer
    for i in range(2):
        ids = needle_case(tok, 280, 0.5, seed=20 + i).prompt_token_ids
        engine.add_request(EngineRequest(str(i), ids, sampling=SamplingParams(max_tokens=300, ignore_eos=True)))
    lengths = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[out.request_id] = len(out.outputs[0].token_ids)
        engine.block_manager.check_invariants()
    assert lengths == {"0": 300, "1": 300}
    assert engine.stats()["num_preemptions"] > 0


def test_with_sparse_retrieval_on_long_prompts_go_sparse_and_short_ones_are_compressed():
    sparse = SparseConfig(enabled=True, init_tokens=64, local_tokens=128, retrieval_block_size=64, dense_boundary=512)
    llm = LLM(dtype="float32", num_pages=256, sparse=sparse, layerwise={"enabled": True})
    tok = llm.get_tokenizer()
    long, short = (needle_case(tok, n, 0.5, seed=30 + n).prompt_token_ids for n in (800, 300))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    both = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[long, short], sampling_params=params)]
    stats = llm.stats()
    assert stats["sparse_seqs_sparse"] == 1 and stats["sparse_seqs_dense"] == 1
    assert stats["layerwise_compacted_seqs"] == 1
    # Each equals its prompt run alone with only its own method on.
    llm.engine.reconfigure(layerwise=LayerwiseConfig())
    assert llm.generate(prompt_token_ids=long, sampling_params=params)[0].outputs[0].token_ids == both[0]
    llm.engine.reconfigure(sparse=dataclasses.replace(sparse, enabled=False))
    llm.engine.reconfigure(layerwise=ON)
    assert llm.generate(prompt_token_ids=short, sampling_params=params)[0].outputs[0].token_ids == both[1]
    llm.engine.block_manager.check_invariants()


def test_settings_that_cannot_work_say_what_to_change():
    with pytest.raises(ValueError, match="to keep that fraction of their tokens pass 4"):
        LayerwiseConfig(compression_ratio=0.25)
    with pytest.raises(ValueError, match="odd"):
        LayerwiseConfig(kernel_size=4)
    with pytest.raises(ValueError, match="unknown layerwise option"):
        EngineConfig.from_options(layerwise={"ratio": 4})
    with pytest.raises(ValueError, match="exceeds the model's 30 layers"):
        LLMEngine.from_options(num_pages=8, layerwise={"enabled": True, "full_layers": 31})


def test_app_config_offline_api_and_engine_share_the_section():
    assert set(LayerwiseSettings.model_fields) == {f.name for f in dataclasses.fields(LayerwiseConfig)}
    assert all(info.description for info in LayerwiseSettings.model_fields.values())
    app = AppConfig(layerwise={"enabled": True, "compression_ratio": 10, "schedule": "uniform"})
    assert app.engine_config().layerwise == LayerwiseConfig(enabled=True, compression_ratio=10, schedule="uniform")
    assert EngineConfig.from_options(layerwise={"enabled": True}).layerwise == ON
