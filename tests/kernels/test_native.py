"""rayapp's C++ CPU decode kernel against the loop reference, and the plain-torch path where it is not built."""

import logging

import pytest
import torch
from test_attention import TOL, make_paged_batch, random_queries

from rayapp.kernels import native
from rayapp.kernels.attention import paged_decode_attention, ref_paged_decode_attention, sdpa_paged_decode_attention

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
    broken = tmp_path / "paged_decode.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
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
