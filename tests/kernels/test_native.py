"""rayapp's C++ CPU kernels (decode attention, retrieval block selection) against the loop references, and the
plain-torch path where they are not built."""

import logging
import math

import pytest
import torch
from test_attention import TOL, make_paged_batch, random_queries

from rayapp.kernels import native
from rayapp.kernels.attention import paged_decode_attention, ref_paged_decode_attention, sdpa_paged_decode_attention
from rayapp.kernels.retrieval import ref_score_blocks, ref_select_topk_blocks, ref_sparse_decode_attention

TOL = {**TOL, torch.float16: dict(atol=2e-3, rtol=2e-3)}


def test_the_cpu_kernel_builds_on_this_machine():
    # CI runs where g++ and ninja are installed: the kernel must build there, not silently fall back.
    assert native.available()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("head_dim,block", [(64, 4), (64, 16), (64, 48), (128, 16), (64, 128)])
def test_the_cpu_kernel_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, block):
    # A lone token, a full page, one token into a page, one short of a page, several pages; pages of 48 and 128
    # tokens are read 16 tokens at a time, the last run of each page short.
    lens = [1, block, block + 1, 3 * block - 1, 5 * block + 3]
    batch = make_paged_batch(lens, num_kv_heads, dtype, head_dim=head_dim, block=block)
    q = random_queries(len(lens), num_heads, dtype, head_dim=head_dim)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, head_dim**-0.5)

    out = native.paged_decode_attention(*args)

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref_paged_decode_attention(*args), **TOL[dtype])


def test_decode_attention_runs_on_the_cpu_kernel(monkeypatch):
    calls = []
    kernel = native.paged_decode_attention
    monkeypatch.setattr(native, "paged_decode_attention", lambda *a: calls.append(a) or kernel(*a))
    batch = make_paged_batch([5, 30], 3, torch.bfloat16, head_dim=64)
    q = random_queries(2, 9, torch.bfloat16, head_dim=64)

    paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, 0.125)

    assert len(calls) == 1
    paged_decode_attention(
        q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.page_table, batch.context_lens, 0.125
    )
    assert len(calls) == 1  # float32 stays on torch's SDPA (native.DTYPES)


def test_a_page_outside_the_cache_is_an_error_not_a_crash():
    batch = make_paged_batch([6], 1, torch.bfloat16, head_dim=64)
    table = batch.page_table.clone()
    table[0, 1] = batch.k_cache.shape[0]  # one past the last page
    q = random_queries(1, 3, torch.bfloat16, head_dim=64)
    with pytest.raises(RuntimeError, match="not a page of the cache"):
        native.paged_decode_attention(q, batch.k_cache, batch.v_cache, table, batch.context_lens, 0.125)


def _fresh_load(monkeypatch) -> None:
    monkeypatch.setattr(native, "_state", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_kernel_matches_the_reference_at_the_native_head_dims(dtype):
    batch = make_paged_batch([9, 17, 1], 3, dtype, head_dim=64)
    q = random_queries(3, 9, dtype, head_dim=64)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, 0.125)
    torch.testing.assert_close(sdpa_paged_decode_attention(*args), ref_paged_decode_attention(*args), **TOL[dtype])


def test_switched_off_decode_attention_runs_in_torch(monkeypatch):
    _fresh_load(monkeypatch)
    monkeypatch.setenv("RAYAPP_NATIVE_KERNELS", "0")
    batch = make_paged_batch([9], 3, torch.bfloat16, head_dim=64)
    assert not native.handles_decode(random_queries(1, 9, torch.bfloat16, head_dim=64), batch.k_cache)


def test_a_kernel_that_cannot_be_built_warns_once_and_leaves_the_torch_path(monkeypatch, tmp_path, caplog):
    _fresh_load(monkeypatch)
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    broken = csrc / "paged_decode.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "CSRC", csrc)
    monkeypatch.setattr(native, "SOURCES", [broken])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not native.available()
        assert not native.available()
    assert len([r for r in caplog.records if "could not be built" in r.message]) == 1


def test_a_lone_sequence_split_by_heads_over_threads_matches_the_reference():
    # Fewer sequences than threads: the kernel splits each sequence's KV heads into work items.
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        batch = make_paged_batch([45], 4, torch.bfloat16, head_dim=64)
        q = random_queries(1, 12, torch.bfloat16, head_dim=64)
        args = (q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens, 0.125)
        torch.testing.assert_close(
            native.paged_decode_attention(*args), ref_paged_decode_attention(*args), **TOL[q.dtype]
        )
    finally:
        torch.set_num_threads(threads)


def _selection_case(dtype, num_heads, num_kv_heads, head_dim, pages=100, blocks=80, reps_per_block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, num_heads, head_dim, generator=g).to(dtype)
    reps = torch.randn(num_kv_heads, pages, reps_per_block, head_dim, generator=g)
    keys = torch.stack([torch.randperm(pages, generator=g)[:blocks] for _ in range(3)])
    # Past one chunk of 64 blocks and within it; a row selecting all its blocks; a row selecting none.
    return q, reps, keys, torch.tensor([blocks, 30, 7]), torch.tensor([17, 30, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_selection_kernel_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim):
    q, reps, keys, num_blocks, num_selected = _selection_case(dtype, num_heads, num_kv_heads, head_dim)

    blocks = native.select_retrieval_blocks(q, reps, keys, num_blocks, num_selected)

    gathered = reps[:, keys].permute(1, 2, 0, 3, 4)  # [B, N, Hkv, R, D]: row b's block i at keys[b, i]
    expected = ref_select_topk_blocks(ref_score_blocks(q, gathered, "multimean"), num_blocks, num_selected)
    assert blocks.shape == (3, num_kv_heads, 30) and blocks.dtype == torch.int64
    for b, k in enumerate(num_selected.tolist()):
        for h in range(num_kv_heads):
            chosen = blocks[b, h, :k].tolist()
            assert chosen == sorted(expected[b][h]), (b, h)
            assert not blocks[b, h, k:].any()


def test_a_block_key_outside_the_representations_is_an_error_not_a_crash():
    q, reps, keys, num_blocks, num_selected = _selection_case(torch.bfloat16, 9, 3, 64)
    keys[1, 5] = reps.shape[1]
    with pytest.raises(RuntimeError, match="not a row of reps"):
        native.select_retrieval_blocks(q, reps, keys, num_blocks, num_selected)
    with pytest.raises(RuntimeError, match="selects 8 of 7 blocks"):
        native.select_retrieval_blocks(q, reps, keys.clamp(max=0), num_blocks, torch.tensor([17, 30, 8]))


def _vllm_vec_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """rayapp's [P, bs, Hkv, D] K and V as vLLM's CPU cache in its `vec` packing: [P, Hkv, bs, 2 * D], per page and
    head K transposed ([D, bs]) then V ([bs, D])."""
    P, bs, H, D = k_cache.shape
    k = k_cache.permute(0, 2, 3, 1).reshape(P, H, bs * D)
    v = v_cache.permute(0, 2, 1, 3).reshape(P, H, bs * D)
    return torch.cat([k, v], dim=2).view(P, H, bs, 2 * D).contiguous()


needs_avx512 = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="the vec pages kernel needs AVX-512"
)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1), (4, 4), (10, 2)])
@pytest.mark.parametrize("head_dim,block", [(64, 128), (64, 32), (128, 64), (64, 16)])
def test_the_vec_pages_kernel_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, block):
    # Each KV head its own pages; one token, a page and a token, and more pages than a work item (8) with the last
    # one partial; padding entries past a row's pages are never read (-1 there would be out of the cache).
    g = torch.Generator().manual_seed(3)
    pages = 30
    k_cache = torch.randn(pages, block, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(pages, block, num_kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, block + 1, 17 * block - 5])
    n = 17
    lists = torch.stack([torch.randperm(pages, generator=g)[:n] for _ in range(len(lens) * num_kv_heads)])
    lists = lists.view(len(lens), num_kv_heads, n)
    for b, length in enumerate(lens.tolist()):
        lists[b, :, math.ceil(length / block) :] = -1
    q = random_queries(len(lens), num_heads, dtype, head_dim=head_dim)

    out = native.vec_pages_decode_attention(q, _vllm_vec_cache(k_cache, v_cache), lists, lens, head_dim**-0.5)

    page_lens = (lens[:, None] - torch.arange(n)[None] * block).clamp(0, block)
    expected = ref_sparse_decode_attention(q, k_cache, v_cache, lists.clamp(min=0), page_lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, **TOL[dtype])


@needs_avx512
def test_a_page_list_outside_the_cache_is_an_error_not_a_crash():
    cache = torch.zeros(4, 3, 32, 128, dtype=torch.bfloat16)
    q = random_queries(1, 9, torch.bfloat16, head_dim=64)
    lists = torch.zeros(1, 3, 2, dtype=torch.int64)
    lists[0, 2, 1] = 4
    with pytest.raises(RuntimeError, match="is not a page of the cache"):
        native.vec_pages_decode_attention(q, cache, lists, torch.tensor([40]), 0.125)
    with pytest.raises(RuntimeError, match="outside 1..64"):
        native.vec_pages_decode_attention(q, cache, lists, torch.tensor([65]), 0.125)
