"""The host pool and the device block cache, on CPU tensors, without a model."""

import pytest
import torch

from rayapp.sparse.block_cache import DeviceBlockCache
from rayapp.sparse.host_pool import HostBlockPool, copy_blocks_to_host

L, RB, H, D, BS = 2, 8, 2, 4, 4
PPB = RB // BS


def test_host_pool_grows_keeps_contents_and_refuses_past_its_limit():
    pool = HostBlockPool((L, RB, H, D), torch.float32, max_blocks=40, pin=False)
    first = pool.allocate(3)
    pool.k[:, first] = 7.0
    more = pool.allocate(20)  # grows
    assert pool.capacity >= 23 and not set(first) & set(more)
    assert (pool.k[:, first] == 7.0).all()
    pool.release(first)
    assert pool.num_used == 20
    with pytest.raises(ValueError, match="host_pool_memory_gb"):
        pool.allocate(21)


def _filled_pool(num_blocks: int) -> HostBlockPool:
    pool = HostBlockPool((L, RB, H, D), torch.float32, max_blocks=64, pin=False)
    ids = pool.allocate(num_blocks)
    for i in ids:  # block i holds the value i everywhere, V holds -i
        pool.k[:, i] = float(i)
        pool.v[:, i] = -float(i)
    return pool


def test_copy_to_host_keeps_token_order_across_pages():
    cache = torch.arange(L * 6 * BS * H * D, dtype=torch.float32).view(L, 6, BS, H, D)
    pool = HostBlockPool((L, RB, H, D), torch.float32, max_blocks=8, pin=False)
    ids = pool.allocate(2)
    copy_blocks_to_host(pool, cache, torch.tensor([[4, 1], [0, 5]]), ids, is_v=False)
    assert torch.equal(pool.k[:, ids[0]], torch.cat([cache[:, 4], cache[:, 1]], dim=1))
    assert torch.equal(pool.k[:, ids[1]], torch.cat([cache[:, 0], cache[:, 5]], dim=1))


def test_block_cache_copies_only_misses_evicts_least_recently_used_per_head():
    pool = _filled_pool(8)
    slots, base = 3, 2
    k_cache = torch.zeros(base + slots * PPB, BS, H, D)
    v_cache = torch.zeros_like(k_cache)
    cache = DeviceBlockCache(L, H, slots, base, PPB, rows=1, max_blocks=8, device=torch.device("cpu"))
    rows = torch.tensor([0])

    def fetch(per_head: list[list[int]]) -> torch.Tensor:
        blocks = torch.tensor([per_head])  # [1, H, K]; host id == block id here
        valid = torch.ones(1, blocks.shape[2], dtype=torch.bool)
        slot = cache.fetch(0, rows, blocks, valid, blocks, pool, k_cache, v_cache)
        pages = cache.slot_pages(slot)  # [1, H, K, ppb]
        for h in range(H):
            for j, b in enumerate(per_head[h]):
                got = k_cache[pages[0, h, j], :, h]
                assert (got == b).all() and (v_cache[pages[0, h, j], :, h] == -b).all()
        return slot

    fetch([[1, 2], [3, 4]])
    assert (cache.stats.hits, cache.stats.misses) == (0, 4)
    fetch([[1, 5], [3, 4]])  # head 0 misses block 5 only
    assert (cache.stats.hits, cache.stats.misses) == (3, 5)
    fetch([[6, 1], [4, 3]])  # head 0: block 2 is the LRU one and is evicted for 6
    assert (cache.stats.hits, cache.stats.misses) == (6, 6)
    assert int(cache.resident[0, 0, 2]) == -1 and int(cache.resident[0, 0, 5]) >= 0
    cache.forget_row(0)
    assert (cache.owner == -1).all() and (cache.resident == -1).all()


def test_block_cache_too_small_for_one_step_says_what_to_raise():
    pool = _filled_pool(8)
    k_cache = torch.zeros(2 * PPB, BS, H, D)
    cache = DeviceBlockCache(L, H, 2, 0, PPB, rows=1, max_blocks=8, device=torch.device("cpu"))
    blocks = torch.tensor([[[1, 2, 3], [1, 2, 3]]])
    with pytest.raises(ValueError, match="device_cache_blocks"):
        cache.fetch(0, torch.tensor([0]), blocks, torch.ones(1, 3, dtype=torch.bool), blocks, pool, k_cache, k_cache)
