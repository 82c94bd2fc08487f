"""The device block cache: an LRU of retrieval blocks per layer and KV head, in device pages.

Offloaded sequences attend their selected middle blocks from here. The cache owns a fixed run
of device pages, `slots` retrieval blocks long (the engine's `KVPool` region `sparse_cache`); slot `s` of
layer `l` and KV head `h` is `k_cache[l][base + s * ppb : base + (s + 1) * ppb, :, h]`, so each
(layer, head) pair is an independent LRU over the same pages. All bookkeeping is tensors, so a
step costs a few vectorized ops per layer, not a Python loop over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rayapp.sparse.host_pool import HostBlockPool

_NEVER = torch.iinfo(torch.int64).max


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0  # = blocks copied in (one KV head of one layer each)


class DeviceBlockCache:
    """LRU residency of (sequence row, middle block) per layer and KV head.

    `rows` and `max_blocks` bound the keys: key = row * max_blocks + block.
    Invariant: `resident[l, h, key] == s` iff `owner[l, h, s] == key`.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        slots: int,
        base_page: int,
        pages_per_block: int,
        rows: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.slots, self.base_page, self.ppb, self.max_blocks = slots, base_page, pages_per_block, max_blocks
        self.device = device
        L, H = num_layers, num_kv_heads
        self.resident = torch.full((L, H, rows * max_blocks), -1, dtype=torch.int64, device=device)
        self.owner = torch.full((L, H, slots), -1, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(L, H, slots, dtype=torch.int64, device=device)
        self.stats = CacheStats()
        self._tick = 0

    def grow_rows(self, rows: int) -> None:
        """Make room for row ids below `rows` (keys keep their value: key = row * max_blocks + block)."""
        L, H, old = self.resident.shape
        extra = torch.full((L, H, rows * self.max_blocks - old), -1, dtype=torch.int64, device=self.device)
        self.resident = torch.cat([self.resident, extra], dim=2)

    def forget_row(self, row: int) -> None:
        """Drop every block of `row` (its sequence ended); its slots become the LRU's first victims."""
        lo, hi = row * self.max_blocks, (row + 1) * self.max_blocks
        held = (self.owner >= lo) & (self.owner < hi)
        self.owner[held] = -1
        self.last_used[held] = 0
        self.resident[:, :, lo:hi] = -1

    def fetch(
        self,
        layer: int,
        rows: Tensor,
        blocks: Tensor,
        valid: Tensor,
        host_ids: Tensor,
        pool: HostBlockPool,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        """Make the selected blocks of `layer` resident; return the slot of each.

        rows: [B] row ids; blocks: [B, H, K] selected middle blocks (per KV head); valid: [B, K];
        host_ids: [B, H, K] host block id of each selection; k_cache, v_cache: [P, bs, H, D] of
        this layer. Only misses are copied in (one head's slice of a block each). Returns
        slots [B, H, K] (0 where invalid).
        """
        self._tick += 1
        B, H, K = blocks.shape
        heads = torch.arange(H, device=self.device)[None, :, None].expand(B, H, K)
        keys = rows[:, None, None] * self.max_blocks + blocks  # [B, H, K]
        ok = valid[:, None, :].expand(B, H, K)
        res = self.resident[layer]  # [H, rows * max_blocks]
        slot = torch.where(ok, res[heads, keys], 0)
        miss = ok & (slot < 0)
        hit = ok & ~miss
        n_hit, n_miss = int(hit.sum()), int(miss.sum())
        self.stats.hits += n_hit
        self.stats.misses += n_miss
        if n_miss:
            slot = self._admit(layer, heads, keys, slot, hit, miss)
            m_heads, m_slots, m_hosts = heads[miss], slot[miss], host_ids[miss]
            self._copy_in(layer, m_heads, m_slots, m_hosts, pool.k[layer], k_cache)
            self._copy_in(layer, m_heads, m_slots, m_hosts, pool.v[layer], v_cache)
        used = self.last_used[layer]
        used[heads[ok], slot[ok]] = self._tick
        return slot.masked_fill(~ok, 0)

    def _admit(self, layer: int, heads: Tensor, keys: Tensor, slot: Tensor, hit: Tensor, miss: Tensor) -> Tensor:
        """Give every miss a slot: per head, the least recently used slots not hit this step."""
        H = self.owner.shape[1]
        age = self.last_used[layer].clone()  # [H, slots]
        age[heads[hit], slot[hit]] = _NEVER  # a block attended this step must not be evicted by it
        misses_per_head = torch.zeros(H, dtype=torch.int64, device=self.device).index_add_(
            0, heads[miss], torch.ones_like(heads[miss])
        )
        free_per_head = (age != _NEVER).sum(dim=1)
        if bool((misses_per_head > free_per_head).any()):
            raise ValueError(
                f"the device block cache has {self.slots} slots per layer and head but this step needs "
                f"{int((misses_per_head + (self.slots - free_per_head)).max())}; raise sparse.device_cache_blocks"
            )
        order = age.argsort(dim=1)  # [H, slots], least recently used first
        m_heads = heads[miss]
        # rank of each miss among its head's misses, in flattened (row, head, k) order
        onehot = torch.nn.functional.one_hot(m_heads, H)
        rank = (onehot.cumsum(0) - 1).gather(1, m_heads[:, None]).squeeze(1)
        victims = order[m_heads, rank]
        evicted = self.owner[layer][m_heads, victims]
        gone = evicted >= 0
        self.resident[layer][m_heads[gone], evicted[gone]] = -1
        m_keys = keys[miss]
        self.owner[layer][m_heads, victims] = m_keys
        self.resident[layer][m_heads, m_keys] = victims
        slot = slot.clone()
        slot[miss] = victims
        return slot

    def _copy_in(self, layer: int, heads: Tensor, slots: Tensor, host_ids: Tensor, host: Tensor, cache: Tensor) -> None:
        # host: [capacity, rb, H, D]; cache: [P, bs, H, D]
        rb = host.shape[1]
        bs = cache.shape[1]
        # src: [M, rb, D], one head's slice of each missing block
        src = host.permute(2, 0, 1, 3)[heads, host_ids]
        tokens = (self.base_page + slots * self.ppb)[:, None] * bs + torch.arange(rb, device=self.device)  # [M, rb]
        flat = cache.view(-1, *cache.shape[2:]).permute(1, 0, 2)  # [H, P * bs, D]
        flat[heads[:, None], tokens] = src.to(self.device, non_blocking=True)

    def slot_pages(self, slots: Tensor) -> Tensor:
        """Device pages of slots [...] -> [..., ppb]."""
        return (self.base_page + slots * self.ppb)[..., None] + torch.arange(self.ppb, device=self.device)
