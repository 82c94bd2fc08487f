"""vLLM's paged KV cache, read and written as cluster-tier blocks.

A tier block holds one page of every layer as `key` and `value` of `[num_layers, block_size,
num_kv_heads, head_dim]` (`rayapp.kvtier.codec.KVBlock`), the layout rayapp's engine writes, so a
block means the same thing whichever engine wrote it. vLLM lays pages out per platform and
attention backend; `PageLayout` names the ones this module reads and writes, found from the
shape of the tensors vLLM registers with the connector:

- `CPU`: vLLM's CPU backend, one tensor per layer `[num_blocks, H, block_size, 2 * D]`: per page
  and head, K's `block_size * D` values, then V's, each packed for the kernel's instruction set
  (`vec`: K transposed, V by token; `amx`: both tiled for AMX). The packing is read from vLLM's
  own choice of instruction set and checked once against vLLM's cache-write kernel.
- `NHD`: FlashAttention and Triton on CUDA, `[2, num_blocks, block_size, H, D]`.
- `HND`: FlashInfer on CUDA, `[2, num_blocks, H, block_size, D]`.
- `SPLIT`: K and V as two tensors `[num_blocks, block_size, H, D]` (vllm-ascend).

Only `CPU` ran here; the CUDA and Ascend layouts follow those backends' `get_kv_cache_shape`.
Any other shape (MLA's latent cache, quantized caches, a CPU instruction set without a known
packing) is refused when the caches are registered, with the reason, never misread.
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
    NHD = "nhd"
    HND = "hnd"
    SPLIT = "split"


def _layout(cache: torch.Tensor | Sequence[torch.Tensor], block_size: int, heads: int, dim: int) -> PageLayout:
    if isinstance(cache, (tuple, list)):
        if len(cache) == 2 and all(t.dim() == 4 and tuple(t.shape[1:]) == (block_size, heads, dim) for t in cache):
            return PageLayout.SPLIT
        shapes = [tuple(t.shape) for t in cache]
        raise ValueError(f"KV cache tensors of shapes {shapes} are not a layout the cluster tier can read")
    shape = tuple(cache.shape)
    if cache.dim() == 4 and shape[1:] == (heads, block_size, 2 * dim):
        return PageLayout.CPU
    if cache.dim() == 5 and shape[0] == 2:
        nhd, hnd = shape[2:] == (block_size, heads, dim), shape[2:] == (heads, block_size, dim)
        if nhd != hnd:  # both when heads == block_size: the shape alone cannot tell them apart
            return PageLayout.NHD if nhd else PageLayout.HND
    raise ValueError(
        f"a KV cache of shape {shape} is not a layout the cluster tier can read (pages of {block_size} tokens, "
        f"{heads} KV heads of {dim}); turn kvtier off for this model or platform"
    )


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
        cpu_isa: str | None = None,
    ) -> PagedKV:
        """`kv_caches` as vLLM registers them (layer name → cache, in layer order). On CPU, `cpu_isa` is
        the instruction set vLLM's CPU attention picked for this cache, and is checked against vLLM's kernel."""
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache with the connector")
        layers = list(kv_caches.values())
        layouts = {_layout(cache, block_size, heads, dim) for cache in layers}
        if len(layouts) != 1:
            raise ValueError(f"layers use different KV cache layouts ({sorted(x.value for x in layouts)})")
        layout = layouts.pop()
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
        page = (bs, h, d)
        if self.layout is PageLayout.CPU:
            return _CPU_PACKINGS[self.cpu_isa](cache.view(cache.shape[0], h, 2, bs * d), bs, h, d)
        if self.layout is PageLayout.HND:  # [2, B, H, bs, D]
            return (cache[0].transpose(1, 2), page), (cache[1].transpose(1, 2), page)
        return (cache[0], page), (cache[1], page)  # NHD, SPLIT: [B, bs, H, D]

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
