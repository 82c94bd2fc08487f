"""The KV cache of one device: the K and V tensors, a null page, and the typed regions that share them.

Page ids index the pool's page dimension (`k`, `v`: `[L, P, bs, Hkv, D]`), laid out as:
- `NULL_PAGE` (0): never handed out. A table entry with no device page (a block whose K/V moved to the host
  pool, a row's padding) names it, so a kernel that reads such an entry reads zeros that belong to nobody;
- `main`: the BlockManager's pages, 1 to `num_main_pages` (sequences' token pages, and the carrier pages that
  layer-wise compression cuts into per-layer slots);
- one region per name reserved at construction, after `main` (`sparse_cache`: the device block cache of
  offloaded sequences).

Layer-wise compression addresses the pool per layer: in `slots()`, the cache flattened to `[L * P, bs, Hkv, D]`,
slot `layer * P + page` is one layer's share of a page (`slot_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rayapp.engine.pages import NULL_PAGE


@dataclass(frozen=True)
class Region:
    """`num_pages` consecutive pool pages from `base`, owned by one component."""

    name: str
    base: int
    num_pages: int

    @property
    def pages(self) -> range:
        return range(self.base, self.base + self.num_pages)


class KVPool:
    """K and V of every layer, one page dimension for all regions; zero-initialised, the null page included."""

    def __init__(
        self,
        page_shape: tuple[int, int, int, int],
        num_main_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        reserved: dict[str, int] | None = None,
    ) -> None:
        """`page_shape`: (layers, block size, KV heads, head dim); `reserved`: pages of each region after `main`."""
        if num_main_pages < 1:
            raise ValueError(f"num_main_pages={num_main_pages} must be >= 1")
        self.main = Region("main", NULL_PAGE + 1, num_main_pages)
        self.regions = {"main": self.main}
        base = self.main.pages.stop
        for name, num_pages in (reserved or {}).items():
            self.regions[name] = Region(name, base, num_pages)
            base += num_pages
        self.num_pages = base
        layers, block_size, heads, dim = page_shape
        self.page_shape = page_shape
        self.k = torch.zeros(layers, self.num_pages, block_size, heads, dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def region(self, name: str) -> Region:
        """The region reserved as `name`; an empty one after the last when none was."""
        return self.regions.get(name, Region(name, self.num_pages, 0))

    def gather(self, page_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """K and V of these pages in every layer, a copy: `[L, n, bs, Hkv, D]` each."""
        pages = self._index(page_ids)
        return self.k.index_select(1, pages), self.v.index_select(1, pages)

    def scatter(self, page_ids: Sequence[int], key: Tensor, value: Tensor) -> None:
        """Write `key`, `value` (`[L, n, bs, Hkv, D]`, any device) into these pages of every layer."""
        pages = self._index(page_ids)
        self.k.index_copy_(1, pages, key.to(self.k.device, self.k.dtype))
        self.v.index_copy_(1, pages, value.to(self.v.device, self.v.dtype))

    def copy(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy each page of `src`, every layer, into the page of `dst` at the same index."""
        key, value = self.gather(src)
        self.scatter(dst, key, value)

    def slots(self) -> tuple[Tensor, Tensor]:
        """K and V flattened to per-layer slots, views of the pool: `[L * P, bs, Hkv, D]` each."""
        shape = (-1, *self.k.shape[2:])
        return self.k.view(shape), self.v.view(shape)

    def slot_ids(self, page_ids: Sequence[int]) -> list[int]:
        """The slots of these pages, page by page and within a page layer by layer."""
        return [layer * self.num_pages + page for page in page_ids for layer in range(self.page_shape[0])]

    def _index(self, page_ids: Sequence[int]) -> Tensor:
        return torch.as_tensor(page_ids, dtype=torch.int64, device=self.k.device)
