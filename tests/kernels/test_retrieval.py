"""Retrieval kernels against their loop references, plus the properties the engine relies on."""

import pytest
import torch

from rayapp.kernels.attention import paged_decode_attention
from rayapp.kernels.retrieval import (
    block_representation,
    oracle_block_scores,
    ref_block_representation,
    ref_score_blocks,
    ref_select_topk_blocks,
    ref_sparse_decode_attention,
    score_blocks,
    select_topk_blocks,
    sparse_decode_attention,
)

D, BS, HKV, HQ = 8, 4, 2, 6


@pytest.mark.parametrize("kind,r", [("mean", 1), ("minmax", 1), ("multimean", 4), ("multimean", 2)])
def test_block_representation_matches_reference(kind, r):
    keys = torch.randn(5, 16, HKV, D, generator=torch.Generator().manual_seed(1))
    got = block_representation(keys, kind, r)
    torch.testing.assert_close(got, ref_block_representation(keys, kind, r), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,r", [("mean", 1), ("minmax", 1), ("multimean", 4)])
def test_block_scores_match_reference(kind, r):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, HQ, D, generator=gen)
    reps = torch.stack([block_representation(torch.randn(7, 16, HKV, D, generator=gen), kind, r) for _ in range(3)])
    torch.testing.assert_close(score_blocks(q, reps, kind), ref_score_blocks(q, reps, kind), atol=1e-4, rtol=1e-4)


def test_minmax_score_bounds_every_key_of_the_block():
    # Quest's bound: no key of the block can score above it, for any query.
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(4, 16, HKV, D, generator=gen)
    q = torch.randn(1, HKV, D, generator=gen)  # one query head per KV head, so the mean over heads is that head
    bound = score_blocks(q, block_representation(keys, "minmax")[None], "minmax")  # [1, Hkv, N]
    exact = torch.einsum("hd,nthd->hnt", q[0], keys).amax(-1)  # [Hkv, N]
    assert (bound[0] >= exact - 1e-5).all()


def test_topk_picks_the_best_valid_blocks_per_head():
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(3, HKV, 10, generator=gen)
    num_blocks, k = torch.tensor([10, 6, 0]), torch.tensor([3, 2, 0])
    blocks, valid = select_topk_blocks(scores, num_blocks, k)
    assert blocks.shape == (3, HKV, 3) and valid.tolist() == [[True] * 3, [True, True, False], [False] * 3]
    expected = ref_select_topk_blocks(scores, num_blocks, k)
    for b in range(3):
        for h in range(HKV):
            chosen = blocks[b, h][valid[b]].tolist()
            assert chosen == sorted(chosen) and set(chosen) == expected[b][h]


def _cache(pages: int, dtype=torch.float32, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(pages, BS, HKV, D, generator=gen).to(dtype), torch.randn(pages, BS, HKV, D, generator=gen).to(
        dtype
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sparse_decode_matches_reference_with_per_head_pages_and_padding(dtype, tol):
    k_cache, v_cache = _cache(20, dtype)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, HQ, D, generator=gen).to(dtype)
    table = torch.randint(0, 20, (2, HKV, 5), generator=gen)
    # Row 0: four full pages and a partial last one; row 1: two full, one partial, two padding.
    lens = torch.tensor([[BS, BS, BS, BS, 2], [BS, BS, 1, 0, 0]])
    got = sparse_decode_attention(q, k_cache, v_cache, table, lens, D**-0.5)
    want = ref_sparse_decode_attention(q, k_cache, v_cache, table, lens, D**-0.5)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_sparse_decode_over_all_pages_equals_dense_decode():
    k_cache, v_cache = _cache(12)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(7))
    pages = torch.tensor([[3, 7, 1, 9]])
    dense = paged_decode_attention(q, k_cache, v_cache, pages, torch.tensor([3 * BS + 2]), D**-0.5)
    lens = torch.tensor([[BS, BS, BS, 2]])
    sparse = sparse_decode_attention(q, k_cache, v_cache, pages[:, None].expand(1, HKV, 4), lens, D**-0.5)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)


def test_oracle_puts_the_mass_on_the_block_holding_the_matching_key():
    k_cache = torch.zeros(8, BS, HKV, D)
    q = torch.zeros(1, HQ, D)
    q[0, :, 0] = 10.0
    k_cache[5, 1, :, 0] = 10.0  # page 5 is block 2's only page
    block_pages = torch.tensor([[[1], [3], [5], [6]]])
    scores = oracle_block_scores(q, k_cache, block_pages, torch.tensor([3]), D**-0.5)
    assert scores.shape == (1, HKV, 4)
    assert (scores[0].argmax(-1) == 2).all() and torch.isinf(scores[0, :, 3]).all()
    torch.testing.assert_close(scores[0, :, :3].sum(-1), torch.full((HKV,), float(HQ // HKV)))
