"""vLLM's KV pages read and written as tier blocks, against vLLM's own cache-write kernel.

The CPU backend packs each page for its instruction set; a tier block must come out as the K and V
vLLM was given for those tokens (`[block_size, H, D]` per layer), whichever packing wrote them, and a
block written back must be the bytes the kernel would have written.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from rayapp.vllm_ext.pages import PagedKV, PageLayout  # noqa: E402

BS, H, D, PAGES = 128, 3, 64, 3


def _kernel_cache(isa: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer CPU cache whose page 1 vLLM's kernel filled with known K and V."""
    cache = torch.zeros(PAGES, H, BS, 2 * D, dtype=dtype)
    key_cache, value_cache = cache.view(PAGES, H, 2 * BS, D).chunk(2, dim=2)
    key, value = torch.randn(BS, H, D).to(dtype), torch.randn(BS, H, D).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(BS) + BS, isa)
    return cache, key, value


@pytest.mark.parametrize(("isa", "dtype"), [("vec", torch.bfloat16), ("vec", torch.float32), ("amx", torch.bfloat16)])
def test_cpu_pages_read_as_the_tokens_kv_and_write_back_as_the_kernel_would(isa, dtype):
    cache, key, value = _kernel_cache(isa, dtype)
    paged = PagedKV.from_registered({"layer.0": cache, "layer.1": cache.clone()}, BS, H, D, isa)
    assert paged.layout is PageLayout.CPU and paged.block_shape == (2, BS, H, D)
    got_key, got_value = paged.gather([1])  # [L, n, bs, H, D]
    assert torch.equal(got_key[0, 0], key) and torch.equal(got_value[0, 0], value)
    paged.scatter(2, got_key[:, 0], got_value[:, 0])
    assert torch.equal(cache[2], cache[1])


def test_gpu_layouts_read_k_and_v_of_the_page():
    key, value = torch.randn(PAGES, BS, H, D), torch.randn(PAGES, BS, H, D)
    nhd = PagedKV.from_registered({"l": torch.stack([key, value])}, BS, H, D)
    hnd = PagedKV.from_registered({"l": torch.stack([key, value]).transpose(2, 3).contiguous()}, BS, H, D)
    split = PagedKV.from_registered({"l": (key, value)}, BS, H, D)
    assert (nhd.layout, hnd.layout, split.layout) == (PageLayout.NHD, PageLayout.HND, PageLayout.SPLIT)
    for paged in (nhd, hnd, split):
        got_key, got_value = paged.gather([2, 0])
        assert torch.equal(got_key[0], key[[2, 0]]) and torch.equal(got_value[0], value[[2, 0]])


def test_layouts_it_cannot_read_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"shape \(3, 1, 128, 576\)"):  # MLA's latent cache, say
        PagedKV.from_registered({"l": torch.zeros(PAGES, 1, BS, 576)}, BS, H, D)
    with pytest.raises(ValueError, match="packs pages for 'neon'"):
        PagedKV.from_registered({"l": torch.zeros(PAGES, H, BS, 2 * D)}, BS, H, D, "neon")
