"""The CUDA and Ascend page layouts, checked on CPU tensors laid out by vLLM's own allocation code.

vLLM 0.32's GPU runner allocates one backing buffer and views each layer as a logical
`[num_blocks, H, block_size, 2 * D]` in the engine's `KVCacheLayout` (`get_kv_cache_config_from_groups`,
then `allocate_kv_cache`); its cache-write kernels store token `t` of slot `s` at
`kv_cache.transpose(1, 2).split(D, -1)[k_or_v][s // block_size, s % block_size]`
(`triton_reshape_and_cache_flash`, whose kernel addresses `[block, offset, head, dim]` through those strides).
vllm-ascend 0.23 allocates K and V apart, each `get_kv_cache_shape(...)[1:]` = `[num_blocks, block_size, H, D]`.
Pages written that way must come out of `PagedKV.gather` as the tokens' K and V, and a block scattered
back must land in exactly its page's bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from rayapp.vllm_ext.pages import PagedKV, PageLayout, page_layout  # noqa: E402

BS, H, D, PAGES, LAYERS = 32, 3, 64, 6, 2
DTYPE = torch.float16
# vllm-ascend's backend, as its model runner's layers hold it (vllm-ascend is not installed here): the layout
# is looked up by the qualified names of the backend's classes.
ASCEND_BACKEND = type("AscendAttentionBackend", (), {"__module__": "vllm_ascend.attention.attention_v1"})


def _cuda_caches(layout: KVCacheLayout, kernel_block: int = BS) -> dict[str, torch.Tensor]:
    """Two layers' caches as vLLM's GPU runner allocates them in `layout`, on the CPU."""
    config = VllmConfig(cache_config=CacheConfig(block_size=BS))
    config.cache_config.kv_cache_layout = layout.name
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=DTYPE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = [KVCacheGroupSpec(names, spec)]
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, PAGES * LAYERS * spec.page_size_bytes)
    assert kv_cache_config.num_blocks == PAGES
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, [kernel_block])


def _write_cuda(cache: torch.Tensor, page: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Tokens 0..BS-1 of vLLM page `page` (`key`, `value`: [BS, H, D]) as vLLM's cache-write kernel stores them:
    slot `page * BS + t`, in kernel blocks of the cache's own page size (vLLM's kernel block table maps
    page `page` to kernel blocks `page * ratio + j`)."""
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # [kernel blocks, kernel_bs, H, D]
    kernel = key_cache.shape[1]
    slots = page * BS + torch.arange(BS)
    key_cache[slots // kernel, slots % kernel] = key
    value_cache[slots // kernel, slots % kernel] = value


def _read_cuda(cache: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    kernel = key_cache.shape[1]
    slots = page * BS + torch.arange(BS)
    return key_cache[slots // kernel, slots % kernel], value_cache[slots // kernel, slots % kernel]


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BS, H, D, generator=gen).to(DTYPE), torch.randn(BS, H, D, generator=gen).to(DTYPE)


@pytest.mark.parametrize(
    ("layout", "kernel_block"),
    [(layout, BS) for layout in KVCacheLayout] + [(KVCacheLayout.LBNHC, 16)],
    ids=[layout.name for layout in KVCacheLayout] + ["LBNHC-kernel-blocks-of-16"],
)
def test_cuda_pages_read_as_the_tokens_kv_in_every_vllm_layout(layout, kernel_block):
    caches = _cuda_caches(layout, kernel_block)
    assert all(c.shape == (PAGES * BS // kernel_block, H, kernel_block, 2 * D) for c in caches.values())
    written = {}
    for layer, cache in enumerate(caches.values()):
        for page in (1, 4):
            written[layer, page] = _kv(10 * layer + page)
            _write_cuda(cache, page, *written[layer, page])
    paged = PagedKV.from_registered(caches, BS, H, D, TritonAttentionBackend)
    assert paged.layout is PageLayout.CHANNELS and paged.block_shape == (LAYERS, BS, H, D)
    key, value = paged.gather([4, 1])  # [L, n, BS, H, D]
    for layer in range(LAYERS):
        for i, page in enumerate((4, 1)):
            assert torch.equal(key[layer, i], written[layer, page][0])
            assert torch.equal(value[layer, i], written[layer, page][1])

    # A block scattered into page 2 is what vLLM's kernels read there, and every other page keeps its bytes.
    before = {
        (layer, page): _read_cuda(cache, page) for layer, cache in enumerate(caches.values()) for page in range(PAGES)
    }
    paged.scatter(2, key[:, 0], value[:, 0])
    for layer, cache in enumerate(caches.values()):
        for page in range(PAGES):
            got_key, got_value = _read_cuda(cache, page)
            want_key, want_value = written[layer, 4] if page == 2 else before[layer, page]
            assert torch.equal(got_key, want_key) and torch.equal(got_value, want_value), (layer, page)


def test_ascend_pages_are_its_separate_k_and_v_tensors():
    # vllm-ascend's runner: raw bytes viewed as get_kv_cache_shape(...)[1:] = [num_blocks, block_size, H, D], K and V
    # apart; torch_npu's reshape_and_cache stores slot s at [s // block_size, s % block_size].
    raw_k, raw_v = (torch.zeros(PAGES * BS * H * D * 2, dtype=torch.int8) for _ in range(2))
    layer = (raw_k.view(DTYPE).view(PAGES, BS, H, D), raw_v.view(DTYPE).view(PAGES, BS, H, D))
    key, value = _kv(7)
    layer[0][5], layer[1][5] = key, value
    paged = PagedKV.from_registered({"model.layers.0.self_attn.attn": layer}, BS, H, D, ASCEND_BACKEND)
    assert paged.layout is PageLayout.SPLIT
    got_key, got_value = paged.gather([5])
    assert torch.equal(got_key[0, 0], key) and torch.equal(got_value[0, 0], value)
    paged.scatter(0, got_key[:, 0], got_value[:, 0])
    assert torch.equal(layer[0][0], key) and torch.equal(layer[1][0], value)


def test_the_layout_comes_from_the_backend_not_the_shape():
    # vLLM's CPU cache and its CUDA caches are both [num_blocks, H, block_size, 2 * D]; only the backend tells.
    assert page_layout(CPUAttentionBackend) is PageLayout.CPU
    assert page_layout(TritonAttentionBackend) is PageLayout.CHANNELS
    subclass = type("RetrievalBackend", (TritonAttentionBackend,), {"__module__": "rayapp.somewhere"})
    assert page_layout(subclass) is PageLayout.CHANNELS


def test_layouts_it_does_not_know_are_refused_at_start_naming_them():
    cache = {"l": torch.zeros(PAGES, H, BS, 2 * D, dtype=DTYPE)}
    unknown = type("FlashAttnMLABackend", (), {"__module__": "vllm.v1.attention.backends.mla.flashattn_mla"})
    with pytest.raises(ValueError, match=r"backend vllm\.v1\.attention\.backends\.mla\.flashattn_mla\.FlashAttnMLA"):
        PagedKV.from_registered(cache, BS, H, D, unknown)
    with pytest.raises(ValueError, match="backend none named"):
        PagedKV.from_registered(cache, BS, H, D, None)
    # Per-token-head quantization pads each half with its scale: not the channels layout of these heads.
    padded = {"l": torch.zeros(PAGES, H, BS, 2 * (D + 2), dtype=DTYPE)}
    with pytest.raises(ValueError, match=r"shape \(6, 3, 32, 132\) is not vLLM's channels page layout"):
        PagedKV.from_registered(padded, BS, H, D, TritonAttentionBackend)
    with pytest.raises(ValueError, match=r"torch\.uint8 KV cache is quantized"):
        PagedKV.from_registered({"l": torch.zeros(PAGES, H, BS, 2 * D, dtype=torch.uint8)}, BS, H, D,
                                TritonAttentionBackend)  # fmt: skip
    with pytest.raises(ValueError, match="is not vLLM's split page layout"):
        PagedKV.from_registered(cache, BS, H, D, ASCEND_BACKEND)
