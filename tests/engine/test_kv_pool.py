"""The KV pool's layout (null page, main pages, reserved regions) and the pages the BlockManager hands out of it."""

from __future__ import annotations

import pytest
import torch

from rayapp.engine.block_manager import BlockManager
from rayapp.engine.kv_pool import KVPool, Region
from rayapp.engine.pages import NULL_PAGE, OFFLOADED
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.sequence import Sequence

BS = 4
PAGE_SHAPE = (3, BS, 2, 8)  # layers, block size, KV heads, head dim


def computed(bm: BlockManager, tokens: list[int], seq_id: str = "s") -> Sequence:
    seq = Sequence(seq_id, tokens, SamplingParams())
    assert bm.allocate(seq, len(tokens), bm.match_prefix(seq))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq


def test_the_null_page_comes_first_then_main_then_each_reserved_region():
    pool = KVPool(PAGE_SHAPE, 5, torch.float32, torch.device("cpu"), {"sparse_cache": 4})
    assert pool.main == Region("main", NULL_PAGE + 1, 5) and pool.main.pages == range(1, 6)
    assert pool.region("sparse_cache").pages == range(6, 10)
    assert pool.region("unreserved") == Region("unreserved", 10, 0)
    assert pool.num_pages == 10 and pool.k.shape == (3, 10, BS, 2, 8) and pool.v.shape == pool.k.shape
    assert not pool.k.any() and not pool.v.any()
    with pytest.raises(ValueError, match="num_main_pages=0"):
        KVPool(PAGE_SHAPE, 0, torch.float32, torch.device("cpu"))


def test_gather_scatter_copy_and_slots_address_the_same_pages():
    pool = KVPool(PAGE_SHAPE, 6, torch.float32, torch.device("cpu"))
    key, value = torch.randn(3, 2, BS, 2, 8), torch.randn(3, 2, BS, 2, 8)
    pool.scatter([4, 2], key, value)
    got_k, got_v = pool.gather([4, 2])
    assert torch.equal(got_k, key) and torch.equal(got_v, value)
    pool.copy([4], [5])
    assert torch.equal(pool.k[:, 5], key[:, 0]) and torch.equal(pool.v[:, 5], value[:, 0])
    flat_k, flat_v = pool.slots()
    assert pool.slot_ids([2, 5]) == [2, 9, 16, 5, 12, 19]  # layer * num_pages + page, page by page
    for slot, (layer, page) in zip(pool.slot_ids([2, 5]), [(0, 2), (1, 2), (2, 2), (0, 5), (1, 5), (2, 5)]):
        assert torch.equal(flat_k[slot], pool.k[layer, page]) and torch.equal(flat_v[slot], pool.v[layer, page])
    assert not pool.k[:, NULL_PAGE].any()


def test_the_block_manager_hands_out_every_main_page_but_never_the_null_page():
    bm = BlockManager(6, BS, "model")
    assert bm.page_ids == range(1, 7)
    seq = computed(bm, list(range(6 * BS)))
    assert sorted(seq.block_table) == list(bm.page_ids) and bm.num_free_pages == 0
    assert not bm.allocate(Sequence("x", [1], SamplingParams()), 1)  # the null page is not free
    bm.check_invariants()


def test_offloaded_entries_name_the_null_page_and_are_never_freed():
    bm = BlockManager(6, BS, "model")
    seq = computed(bm, list(range(4 * BS)))
    bm.release_pages(seq, [0, 1])
    assert OFFLOADED == NULL_PAGE and seq.block_table[:2] == [NULL_PAGE, NULL_PAGE]
    assert bm.num_used_pages == 2
    bm.free(seq)
    assert bm.num_used_pages == 0 and bm.num_free_pages == 6
    bm.check_invariants()


def test_compaction_moves_a_sequence_from_token_pages_to_carrier_pages():
    bm = BlockManager(8, BS, "model")
    prompt = list(range(5 * BS))
    seq = computed(bm, prompt)
    token_pages = list(seq.block_table)
    assert bm.allocate_carriers(seq, 9) is None  # 3 free + 5 released < 9: nothing changed
    assert seq.block_table == token_pages and not seq.compacted
    carriers = bm.allocate_carriers(seq, 2)
    assert carriers is not None and seq.carrier_pages == carriers and seq.compacted
    assert seq.block_table == [] and not set(carriers) & set(token_pages)  # LRU first: released pages last
    more = bm.allocate_carriers(seq, 1)
    assert more is not None and seq.carrier_pages == carriers + more and bm.num_used_pages == 3
    # The prompt's blocks stay cached: a later turn still hits them.
    assert bm.match_prefix(Sequence("next", prompt + [7], SamplingParams())).num_tokens == 5 * BS
    bm.free(seq)
    assert (seq.carrier_pages, seq.compacted, bm.num_used_pages) == ([], False, 0)
    bm.check_invariants()
