"""vLLM's paged KV cache, read and written as cluster-tier blocks.

A tier block holds one page of every layer as `key` and `value` of `[num_layers, block_size,
num_kv_heads, head_dim]` (`rayapp.kvtier.codec.KVBlock`), the layout rayapp's engine writes, so a
block means the same thing whichever engine wrote it. vLLM lays pages out per platform and
attention backend; `PageLayout` names the ones this module reads and writes. The layout comes from
the attention backend the layers run (`page_layout`), never from a tensor's shape: vLLM's CPU cache
and its CUDA caches have the same logical shape and different contents.

- `CPU`: vLLM's CPU backend, one tensor per layer `[num_blocks, H, block_size, 2 * D]`: per page
  and head, K's `block_size * D` values, then V's, each packed for the kernel's instruction set
  (`vec`: K transposed, V by token; `amx`: both tiled for AMX). The packing is read from vLLM's
  own choice of instruction set and checked once against vLLM's cache-write kernel.
- `CHANNELS`: vLLM 0.32 on CUDA (FlashAttention, Triton, FlashInfer, FlexAttention), one tensor per layer,
  logically `[num_blocks, H, block_size, 2 * D]` with K and V as the channel halves of each token
  (`kv_cache.transpose(1, 2).split(D, -1)` in those backends); its physical order is the engine's
  `KVCacheLayout` (LBNHC by default), which this module follows through the tensor's strides.
- `SPLIT`: vllm-ascend 0.23, K and V as two tensors `[num_blocks, block_size, H, D]`.

Where vLLM splits a page into kernel blocks (`block_size` a multiple of the tensors' pages), the
`block_size // kernel_block` kernel blocks of page `p` are `p * ratio ...`, as vLLM groups them.
Any other backend, shape or dtype (MLA's latent cache, quantized caches, a CPU instruction set without a
known packing) is refused when the caches are registered, naming it, never misread.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

# A layer's K (or V) as a strided view `[num_blocks, *page_shape]`, and the page shape: a page's
# canonical `[block_size, H, D]` values viewed as `page_shape` line up with the view element for element.
_Split = tuple[torch.Tensor, tuple[int, ...]]


class PageLayout(enum.Enum):
    CPU = "cpu"
    CHANNELS = "channels"
    SPLIT = "split"


# Attention backends by the qualified name of a class in their MRO (rayapp's retrieval backends subclass these).
BACKEND_LAYOUTS: dict[str, PageLayout] = {
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend": PageLayout.CPU,
    "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend": PageLayout.CHANNELS,
    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend": PageLayout.CHANNELS,
    "vllm.v1.attention.backends.flashinfer.FlashInferBackend": PageLayout.CHANNELS,
    "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend": PageLayout.CHANNELS,
    "vllm_ascend.attention.attention_v1.AscendAttentionBackend": PageLayout.SPLIT,
}
# Quantized caches carry scales beside the pages (or in them); a tier block of their bytes would not mean the same.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def page_layout(backend: type | None) -> PageLayout:
    """The page layout of vLLM attention backend `backend` (its class, as the attention layers hold it)."""
    for cls in getattr(backend, "__mro__", ()):
        layout = BACKEND_LAYOUTS.get(f"{cls.__module__}.{cls.__qualname__}")
        if layout is not None:
            return layout
    name = f"{backend.__module__}.{backend.__qualname__}" if backend is not None else "none named"
    known = ", ".join(path.rsplit(".", 1)[1] for path in BACKEND_LAYOUTS)
    raise ValueError(
        f"the cluster tier does not know the KV page layout of vLLM attention backend {name} (it reads {known}); "
        "turn kvtier off for this model or platform"
    )


def _kernel_block(cache, layout: PageLayout, heads: int, dim: int) -> int | None:
    """Tokens per page of `cache`'s tensors; None where `cache` is not `layout`'s shape for `heads` x `dim`."""
    if layout is PageLayout.SPLIT:
        if not (isinstance(cache, (tuple, list)) and len(cache) == 2):
            return None
        k, v = cache
        if k.shape != v.shape or k.dim() != 4 or tuple(k.shape[2:]) != (heads, dim):
            return None
        return k.shape[1]
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or (cache.shape[1], cache.shape[3]) != (heads, 2 * dim):
        return None
    return cache.shape[2]


def _check_shape(cache, layout: PageLayout, block_size: int, heads: int, dim: int) -> None:
    """Raise unless `cache` is a layer's cache in `layout` for pages of `block_size` tokens, `heads` x `dim`."""
    tensors = list(cache) if isinstance(cache, (tuple, list)) else [cache]
    kernel = _kernel_block(cache, layout, heads, dim)
    ok = kernel is not None and block_size % kernel == 0 and (layout is not PageLayout.CPU or kernel == block_size)
    if not (ok and tensors[0].shape[0] % (block_size // kernel) == 0):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"a KV cache of shape {shapes[0] if len(shapes) == 1 else shapes} is not vLLM's {layout.value} page "
            f"layout for pages of {block_size} tokens, {heads} KV heads of {dim}; turn kvtier off for this model"
        )
    if tensors[0].dtype not in _DTYPES:
        raise ValueError(f"a {tensors[0].dtype} KV cache is quantized; the cluster tier reads {list(_DTYPES)}")


def _cpu_vec(pages: torch.Tensor, bs: int, h: int, d: int) -> tuple[_Split, _Split]:
    # pages: [B, H, K|V, bs * D]. K is stored transposed ([D, bs] per head), V by token ([bs, D]).
    b = pages.shape[0]
    k = pages[:, :, 0].view(b, h, d, bs).permute(0, 3, 1, 2)
    v = pages[:, :, 1].view(b, h, bs, d).permute(0, 2, 1, 3)
    return (k, (bs, h, d)), (v, (bs, h, d))


def _cpu_amx(pages: torch.Tensor, bs: int, h: int, d: int) -> tuple[_Split, _Split]:
    # AMX tiles: K as [bs/16, D/2, 16 tokens, 2 dims], V as [D/16, bs/2, 16 dims, 2 tokens] per head.
    b = pages.shape[0]
    k = pages[:, :, 0].view(b, h, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    v = pages[:, :, 1].view(b, h, d // 16, bs // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
    return (k, (bs // 16, 16, h, d // 2, 2)), (v, (bs // 2, 2, h, d // 16, 16))


_CPU_PACKINGS: dict[str, Callable[[torch.Tensor, int, int, int], tuple[_Split, _Split]]] = {
    "vec": _cpu_vec,
    "amx": _cpu_amx,
}


def _whole_pages(kernel_pages: torch.Tensor, bs: int) -> _Split:
    """K or V as `[num_kernel_blocks, kernel_bs, H, D]` grouped into vLLM's pages of `bs` tokens."""
    _, kernel, h, d = kernel_pages.shape
    if kernel == bs:
        return kernel_pages, (bs, h, d)
    return kernel_pages.unflatten(0, (-1, bs // kernel)), (bs // kernel, kernel, h, d)


def cpu_page_keys(cache: torch.Tensor, isa: str, page_ids: torch.Tensor) -> torch.Tensor:
    """The keys of pages `page_ids` of one layer's CPU cache (`[num_blocks, H, block_size, 2 * D]`, packed for
    `isa`), as `[n, block_size, H, D]`."""
    num_blocks, h, bs, d = cache.shape[0], cache.shape[1], cache.shape[2], cache.shape[3] // 2
    (k, _), _ = _CPU_PACKINGS[isa](cache.view(num_blocks, h, 2, bs * d), bs, h, d)
    return k[page_ids].reshape(page_ids.shape[0], bs, h, d)


@dataclass
class PagedKV:
    """The KV caches of every attention layer, in layer order, and how to copy pages in and out."""

    layers: list[torch.Tensor | Sequence[torch.Tensor]]
    layout: PageLayout
    block_size: int
    num_kv_heads: int
    head_dim: int
    # The CPU kernel's instruction set (`vec`, `amx`), which decides how a page is packed; None elsewhere.
    cpu_isa: str | None = None

    @classmethod
    def from_registered(
        cls,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        block_size: int,
        heads: int,
        dim: int,
        backend: type | None,
        cpu_isa: str | None = None,
    ) -> PagedKV:
        """`kv_caches` as vLLM registers them (layer name → cache, in layer order), written by attention
        backend `backend` (the class the layers hold). On CPU, `cpu_isa` is the instruction set vLLM's CPU
        attention picked for this cache, and is checked against vLLM's kernel."""
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache with the connector")
        layout = page_layout(backend)
        layers = list(kv_caches.values())
        for cache in layers:
            _check_shape(cache, layout, block_size, heads, dim)
        if layout is PageLayout.CPU and cpu_isa not in _CPU_PACKINGS:
            raise ValueError(
                f"vLLM's CPU attention packs pages for {cpu_isa!r}; the cluster tier reads {sorted(_CPU_PACKINGS)}"
            )
        paged = cls(layers, layout, block_size, heads, dim, cpu_isa if layout is PageLayout.CPU else None)
        if layout is PageLayout.CPU:
            paged.check_cpu_packing()
        return paged

    def check_cpu_packing(self) -> None:
        """Write a page with vLLM's own CPU cache-write kernel and read it back: raise if this module's
        packing for `cpu_isa` differs from the kernel's (a vLLM release that changed it)."""
        from vllm import _custom_ops as ops

        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        scratch = torch.zeros(1, h, bs, 2 * d, dtype=self.dtype)
        key_cache, value_cache = scratch.view(1, h, 2 * bs, d).chunk(2, dim=2)
        generator = torch.Generator().manual_seed(0)
        key, value = (torch.randn(bs, h, d, generator=generator).to(self.dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(bs), self.cpu_isa)
        probe = PagedKV([scratch], self.layout, bs, h, d, self.cpu_isa)
        got_key, got_value = probe.gather([0])
        if not (torch.equal(got_key[0, 0], key) and torch.equal(got_value[0, 0], value)):
            raise ValueError(f"vLLM's CPU KV pages for {self.cpu_isa!r} are not packed as the cluster tier reads them")

    @property
    def dtype(self) -> torch.dtype:
        first = self.layers[0]
        return first[0].dtype if isinstance(first, (tuple, list)) else first.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """The shape of a tier block's `key` (and `value`) for this cache."""
        return (len(self.layers), self.block_size, self.num_kv_heads, self.head_dim)

    def _split(self, cache: torch.Tensor | Sequence[torch.Tensor]) -> tuple[_Split, _Split]:
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.layout is PageLayout.CPU:
            return _CPU_PACKINGS[self.cpu_isa](cache.view(cache.shape[0], h, 2, bs * d), bs, h, d)
        if self.layout is PageLayout.CHANNELS:  # logical [B, H, bs, 2 * D], any physical order
            k, v = cache.transpose(1, 2).split(d, dim=-1)
            return _whole_pages(k, bs), _whole_pages(v, bs)
        return _whole_pages(cache[0], bs), _whole_pages(cache[1], bs)  # SPLIT: [B, bs, H, D] each

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the pages `block_ids` as K and V `[num_layers, n, block_size, H, D]` on the CPU."""
        n = len(block_ids)
        shape = (n, self.block_size, self.num_kv_heads, self.head_dim)
        keys, values = [], []
        for cache in self.layers:
            (k, _), (v, _) = self._split(cache)
            index = torch.tensor(block_ids, dtype=torch.long, device=k.device)
            keys.append(k[index].reshape(shape).cpu())
            values.append(v[index].reshape(shape).cpu())
        return torch.stack(keys), torch.stack(values)

    def scatter(self, block_id: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one tier block (`key`, `value`: `[num_layers, block_size, H, D]`) into page `block_id`."""
        for layer, cache in enumerate(self.layers):
            (k, k_page), (v, v_page) = self._split(cache)
            k[block_id].copy_(key[layer].reshape(k_page))
            v[block_id].copy_(value[layer].reshape(v_page))
