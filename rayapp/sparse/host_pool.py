"""Host memory for offloaded retrieval blocks (the DDR tier), grown on demand up to a limit."""

from __future__ import annotations

import torch
from torch import Tensor


class HostBlockPool:
    """K and V of whole retrieval blocks, all layers, in host memory.

    Layout: `k`, `v` are `[L, capacity, rb, Hkv, D]`; a block id indexes dim 1. Pinned when the
    device is CUDA, so copies to the device can overlap. Capacity doubles when full, up to
    `max_blocks`; past that `allocate` raises with the setting to change.
    """

    def __init__(self, block_shape: tuple[int, int, int, int], dtype: torch.dtype, max_blocks: int, pin: bool) -> None:
        # block_shape: (L, rb, Hkv, D)
        self.block_shape, self.dtype, self.max_blocks, self.pin = block_shape, dtype, max_blocks, pin
        self.capacity = 0
        L, rb, Hkv, D = block_shape
        self.k = self.v = torch.empty(L, 0, rb, Hkv, D, dtype=dtype)
        self._free: list[int] = []

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` block ids (growing the pool if needed)."""
        if n > len(self._free):
            self._grow(self.num_used + n)
        taken, self._free = self._free[-n:] if n else [], self._free[: len(self._free) - n]
        return taken

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def _grow(self, needed: int) -> None:
        if needed > self.max_blocks:
            raise ValueError(
                f"the host pool needs {needed} retrieval blocks but host_pool_memory_gb allows {self.max_blocks}; "
                f"raise sparse.host_pool_memory_gb or lower offload traffic (fewer long sequences at once)"
            )
        capacity = min(self.max_blocks, max(needed, 2 * self.capacity, 16))
        L, rb, Hkv, D = self.block_shape
        k = torch.empty(L, capacity, rb, Hkv, D, dtype=self.dtype, pin_memory=self.pin)
        v = torch.empty(L, capacity, rb, Hkv, D, dtype=self.dtype, pin_memory=self.pin)
        k[:, : self.capacity] = self.k
        v[:, : self.capacity] = self.v
        self.k, self.v = k, v
        # Newest ids last: `allocate` pops from the end, so the old free ids are reused first.
        self._free = list(range(capacity - 1, self.capacity - 1, -1)) + self._free
        self.capacity = capacity


def copy_blocks_to_host(pool: HostBlockPool, cache: Tensor, pages: Tensor, block_ids: list[int], is_v: bool) -> None:
    """Copy whole blocks from a device cache `[L, P, bs, Hkv, D]` into the pool.

    pages: [n, ppb] device pages of each block, in token order; block_ids: n host ids.
    """
    L, _, bs, Hkv, D = cache.shape
    n, ppb = pages.shape
    # blocks: [L, n, rb, Hkv, D]
    blocks = cache.index_select(1, pages.reshape(-1)).view(L, n, ppb * bs, Hkv, D)
    target = pool.v if is_v else pool.k
    target.index_copy_(1, torch.tensor(block_ids, dtype=torch.int64), blocks.to("cpu", non_blocking=pool.pin))
