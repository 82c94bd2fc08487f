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
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402

from rayapp.vllm_ext.pages import PagedKV, PageLayout  # noqa: E402

BS, H, D, PAGES = 128, 3, 64, 3


def _kernel_cache(isa: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer CPU cache whose page 1 vLLM's kernel filled with known K and V."""
    cache = torch.zeros(PAGES, H, BS, 2 * D, dtype=dtype)
    key_cache, value_cache = cache.view(PAGES, H, 2 * BS, D).chunk(2, dim=2)
    key, value = torch.randn(BS, H, D).to(dtype), torch.randn(BS, H, D).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(BS) + BS, isa)
    return cache, key, value


AMX = pytest.mark.skipif(
    not torch.cpu._is_avx512_supported(), reason="vLLM's CPU attention writes its AMX layout only on AVX-512 CPUs"
)


@pytest.mark.parametrize(
    ("isa", "dtype"), [("vec", torch.bfloat16), ("vec", torch.float32), pytest.param("amx", torch.bfloat16, marks=AMX)]
)
def test_cpu_pages_read_as_the_tokens_kv_and_write_back_as_the_kernel_would(isa, dtype):
    cache, key, value = _kernel_cache(isa, dtype)
    caches = {"layer.0": cache, "layer.1": cache.clone()}
    paged = PagedKV.from_registered(caches, BS, H, D, CPUAttentionBackend, isa)
    assert paged.layout is PageLayout.CPU and paged.block_shape == (2, BS, H, D)
    got_key, got_value = paged.gather([1])  # [L, n, bs, H, D]
    assert torch.equal(got_key[0, 0], key) and torch.equal(got_value[0, 0], value)
    paged.scatter(2, got_key[:, 0], got_value[:, 0])
    assert torch.equal(cache[2], cache[1])


def test_cpu_layouts_it_cannot_read_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"shape \(3, 1, 128, 576\) is not vLLM's cpu page layout"):  # MLA's, say
        PagedKV.from_registered({"l": torch.zeros(PAGES, 1, BS, 576)}, BS, H, D, CPUAttentionBackend, "vec")
    with pytest.raises(ValueError, match="packs pages for 'neon'"):
        PagedKV.from_registered({"l": torch.zeros(PAGES, H, BS, 2 * D)}, BS, H, D, CPUAttentionBackend, "neon")
