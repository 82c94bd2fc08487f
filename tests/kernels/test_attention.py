"""Paged attention kernels against their loop references and against plain causal SDPA."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from rayapp.kernels import attention
from rayapp.kernels.attention import (
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    store_kv,
)

D = 16
BLOCK = 4
# Slots no sequence owns hold loud values: any leak through the mask swamps the output.
POISON_K, POISON_V = 10.0, 1e3
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclass(frozen=True)
class PagedBatch:
    """Sequences' K/V spread over shuffled pages, plus each sequence's K/V kept contiguous."""

    k_cache: Tensor  # [P, bs, Hkv, D]
    v_cache: Tensor  # [P, bs, Hkv, D]
    page_table: Tensor  # [S, max_pages + padding]
    context_lens: Tensor  # [S]
    keys: list[Tensor]  # per sequence [ctx, Hkv, D]
    values: list[Tensor]  # per sequence [ctx, Hkv, D]


def make_paged_batch(
    context_lens: list[int],
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
    pad_pages: int = 2,
    table_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    head_dim: int = D,
    block: int = BLOCK,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-ctx // block) for ctx in context_lens]
    num_pages = sum(pages_per_seq) + 3  # a few pages nobody owns
    shuffled = torch.randperm(num_pages, generator=gen).tolist()
    shape = (num_pages, block, num_kv_heads, head_dim)
    k_cache = torch.full(shape, POISON_K, dtype=dtype)
    v_cache = torch.full(shape, POISON_V, dtype=dtype)
    # Padding entries point at page 0, which usually belongs to some other sequence.
    page_table = torch.zeros(len(context_lens), max(pages_per_seq) + pad_pages, dtype=table_dtype)
    keys, values = [], []
    for s, ctx in enumerate(context_lens):
        pages = [shuffled.pop() for _ in range(pages_per_seq[s])]
        page_table[s, : len(pages)] = torch.tensor(pages, dtype=table_dtype)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(ctx):
            k_cache[pages[t // block], t % block] = k[t]
            v_cache[pages[t // block], t % block] = v[t]
        keys.append(k)
        values.append(v)
    lens = torch.tensor(context_lens)
    return PagedBatch(k_cache, v_cache, page_table, lens, keys, values)


def random_queries(num_tokens: int, num_heads: int, dtype: torch.dtype, seed: int = 1, head_dim: int = D) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)


def cu_seqlens(q_lens: list[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])


def causal_sdpa_with_repeat_kv(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Independent reference: Hugging Face style repeat_kv, then SDPA's own causal mask.

    q: [n, Hq, D], k, v: [n, Hkv, D], all float32; returns [n, Hq, D].
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def test_store_kv_puts_each_token_at_its_page_and_offset():
    k_cache = torch.zeros(5, BLOCK, 2, D)
    v_cache = torch.zeros(5, BLOCK, 2, D)
    k, v = torch.randn(3, 2, D), torch.randn(3, 2, D)
    # page 3 offset 1, page 0 offset 3, page 4 offset 0
    store_kv(k, v, k_cache, v_cache, torch.tensor([3 * BLOCK + 1, 3, 4 * BLOCK]))
    torch.testing.assert_close(k_cache[3, 1], k[0])
    torch.testing.assert_close(v_cache[0, 3], v[1])
    torch.testing.assert_close(k_cache[4, 0], k[2])
    assert (k_cache != 0).any(dim=(-1, -2)).sum() == 3, "only the three slots are written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (6, 2)])
def test_decode_matches_reference_with_shuffled_pages(dtype, num_heads, num_kv_heads):
    # With 4-token pages: a lone token, one full page, one token into a page, one short of a page.
    batch = make_paged_batch([1, 4, 5, 23, 40], num_kv_heads, dtype)
    q = random_queries(5, num_heads, dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, D**-0.5)

    out = paged_decode_attention(*args)

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref_paged_decode_attention(*args), **TOL[dtype])


def test_both_kernels_accept_an_int32_page_table():
    batch = make_paged_batch([7, 18], 1, table_dtype=torch.int32)
    cache = (batch.k_cache, batch.v_cache, batch.page_table)
    q = random_queries(2, 3, torch.float32)
    decode_args = (q, *cache, batch.context_lens, D**-0.5)
    torch.testing.assert_close(paged_decode_attention(*decode_args), ref_paged_decode_attention(*decode_args))
    chunk = random_queries(7, 3, torch.float32)
    prefill_args = (chunk, *cache, cu_seqlens([3, 4]), batch.context_lens, D**-0.5)
    torch.testing.assert_close(paged_prefill_attention(*prefill_args), ref_paged_prefill_attention(*prefill_args))


def test_decode_of_the_last_token_equals_causal_attention_over_the_whole_sequence():
    batch = make_paged_batch([13, 30], 2)
    q = random_queries(2, 6, torch.float32)

    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, D**-0.5)

    for b in range(2):
        # The last row of a causal pass sees every key, as the decode query does.
        full_q = torch.cat([torch.zeros(len(batch.keys[b]) - 1, 6, D), q[b : b + 1]])
        expected = causal_sdpa_with_repeat_kv(full_q, batch.keys[b], batch.values[b], D**-0.5)
        torch.testing.assert_close(out[b], expected[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (6, 2)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_prefill_after_a_cached_prefix_matches_reference(dtype, num_heads, num_kv_heads, return_lse):
    # (new tokens, context after them): a fresh prompt, a chunk after a prefix, a decode-like
    # single token, and a chunk whose prefix ends mid-page.
    q_lens, context_lens = [9, 6, 1, 11], [9, 21, 17, 14]
    batch = make_paged_batch(context_lens, num_kv_heads, dtype)
    q = random_queries(sum(q_lens), num_heads, dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, cu_seqlens(q_lens))
    args += (batch.context_lens, D**-0.5, return_lse)

    got, expected = paged_prefill_attention(*args), ref_paged_prefill_attention(*args)

    if return_lse:
        (out, lse), (ref_out, ref_lse) = got, expected
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    else:
        out, ref_out = got, expected
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("return_lse", [False, True])
def test_prefill_over_pages_given_from_host_memory_equals_prefill_over_the_cache(return_lse):
    # Sequence 1's pages 1-3 are not in the cache (-1 in its table) but handed over, as a resumed history's
    # middle is from the sparse host pool; the cache slots they would have used hold poison.
    q_lens, context_lens = [5, 3], [18, 21]
    batch = make_paged_batch(context_lens, 2)
    q = random_queries(sum(q_lens), 6, torch.float32)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, cu_seqlens(q_lens), batch.context_lens, D**-0.5)
    expected = paged_prefill_attention(*args, return_lse)
    moved = batch.page_table[1, 1:4].clone()
    host = {1: (1, batch.k_cache[moved].clone(), batch.v_cache[moved].clone())}
    k_cache, v_cache, table = batch.k_cache.clone(), batch.v_cache.clone(), batch.page_table.clone()
    k_cache[moved], v_cache[moved], table[1, 1:4] = POISON_K, POISON_V, -1

    got = paged_prefill_attention(q, k_cache, v_cache, table, *args[4:], return_lse, host_pages=host)

    for g, e in zip(got, expected) if return_lse else [(got, expected)]:
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("return_lse", [False, True])
def test_prefill_split_into_row_chunks_matches_reference(monkeypatch, return_lse):
    # 3-row chunks put chunk edges inside prefixes, pages and short sequences.
    monkeypatch.setattr(attention, "_rows_per_chunk", lambda num_heads, keys, preferred: 3)
    q_lens, context_lens = [10, 2, 7], [10, 19, 30]
    batch = make_paged_batch(context_lens, 2)
    q = random_queries(sum(q_lens), 6, torch.float32)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, cu_seqlens(q_lens))
    args += (batch.context_lens, D**-0.5, return_lse)
    torch.testing.assert_close(paged_prefill_attention(*args), ref_paged_prefill_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("return_lse", [False, True])
def test_single_token_chunks_agree_with_decode(return_lse):
    batch = make_paged_batch([3, 16, 29], 1, pad_pages=0)
    q = random_queries(3, 3, torch.float32)

    out = paged_prefill_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.page_table,
        cu_seqlens([1, 1, 1]),
        batch.context_lens,
        D**-0.5,
        return_lse,
    )

    decoded = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, D**-0.5)
    torch.testing.assert_close(out[0] if return_lse else out, decoded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (9, 3)])
def test_fresh_prompts_equal_causal_sdpa_with_repeat_kv(num_heads, num_kv_heads):
    q_lens = [5, 12, 33]
    batch = make_paged_batch(q_lens, num_kv_heads)
    q = random_queries(sum(q_lens), num_heads, torch.float32)
    starts = cu_seqlens(q_lens)

    out, lse = paged_prefill_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.page_table,
        starts,
        batch.context_lens,
        D**-0.5,
        return_lse=True,
    )
    plain = paged_prefill_attention(
        q, batch.k_cache, batch.v_cache, batch.page_table, starts, batch.context_lens, D**-0.5
    )

    for s in range(3):
        rows = slice(starts[s], starts[s + 1])
        expected = causal_sdpa_with_repeat_kv(q[rows], batch.keys[s], batch.values[s], D**-0.5)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plain[rows], expected, atol=1e-5, rtol=1e-5)
    # The first token of a prompt sees only itself, so its lse is its own scaled score.
    group = num_heads // num_kv_heads
    first_key = batch.keys[0][0].repeat_interleave(group, dim=0)
    torch.testing.assert_close(lse[0], (q[0] * first_key).sum(-1) * D**-0.5)


def test_prompt_written_in_chunks_then_decoded_equals_one_causal_pass():
    # A user's prompt of 14 tokens is prefilled as 8 + 6 and then one token is decoded,
    # every K/V going through store_kv into pages handed out out of order.
    num_heads, num_kv_heads, n = 6, 2, 15
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    k_cache, v_cache = torch.zeros(8, BLOCK, num_kv_heads, D), torch.zeros(8, BLOCK, num_kv_heads, D)
    pages = torch.tensor([6, 1, 4, 0])
    page_table = pages[None]
    slots = pages.repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(4)

    outputs = []
    for lo, hi in [(0, 8), (8, 14)]:
        store_kv(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi])
        outputs.append(
            paged_prefill_attention(
                q[lo:hi],
                k_cache,
                v_cache,
                page_table,
                torch.tensor([0, hi - lo]),
                torch.tensor([hi]),
                D**-0.5,
            )
        )
    store_kv(k[14:], v[14:], k_cache, v_cache, slots[14:15])
    outputs.append(paged_decode_attention(q[14:], k_cache, v_cache, page_table, torch.tensor([15]), D**-0.5))

    expected = causal_sdpa_with_repeat_kv(q, k, v, D**-0.5)
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-5, rtol=1e-5)


def test_prefill_rejects_more_new_tokens_than_the_context_holds():
    batch = make_paged_batch([4], 1)
    q = random_queries(5, 1, torch.float32)
    with pytest.raises(ValueError, match="5 new tokens but context_lens is 4"):
        paged_prefill_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.page_table,
            cu_seqlens([5]),
            batch.context_lens,
            D**-0.5,
        )
