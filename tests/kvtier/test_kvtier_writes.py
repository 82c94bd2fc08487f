"""The tier client's writer: runs the engine queued together reach the store in one call, and each is still
announced to the prefix router on its own. Real embedded PostgreSQL, a real store actor."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch

from rayapp.blocks import BlockStored, Tier, hash_blocks
from rayapp.config import KVTierConfig
from rayapp.kvtier.client import KVTierClient

MODEL, BS, DIM = "m", 16, 192


def runs() -> list[tuple[BlockStored, str]]:
    """Three runs as an engine caches them: tenant a's first 3 blocks, tenant b's 2, then a's next 2."""
    tokens = list(range(1000, 1000 + 5 * BS))
    a, b = hash_blocks(tokens, BS, (MODEL, "a")), hash_blocks(tokens, BS, (MODEL, "b"))
    return [
        (BlockStored(tuple(a[:3]), None, tuple(tokens[: 3 * BS]), BS), "a"),
        (BlockStored(tuple(b[:2]), None, tuple(tokens[: 2 * BS]), BS), "b"),
        (BlockStored(tuple(a[3:]), a[2], tuple(tokens[3 * BS :]), BS), "a"),
    ]


@pytest.mark.parametrize(
    ("options", "calls"),
    [({"coalesce_s": 2.0}, 1), ({"coalesce_s": 0.0, "max_batch_bytes": 1}, 3)],
    ids=["queued-together", "one-run-per-call"],
)
def test_runs_queued_together_reach_the_store_in_one_call_and_are_announced_run_by_run(
    cluster, catalog, dsn, options, calls
):
    client = KVTierClient(KVTierConfig(enabled=True, dsn=dsn, capacity_bytes=64 << 20), MODEL, BS, DIM, **options)
    try:
        for stored, salt in runs():
            pages = torch.randn(2, len(stored.block_hashes), BS, 3, 64).bfloat16()
            client.write(stored, salt, pages, pages.clone())
        client.flush()
        stats = client.stats()
        assert stats["tier_write_batches"] == calls
        assert stats["tier_written_blocks"] == 7 and stats["tier_skipped_blocks"] == 0
        assert client.take_events() == [dataclasses.replace(stored, tier=Tier.CLUSTER) for stored, _ in runs()]
        (a_head, _), (b, _), (a_tail, _) = runs()
        assert catalog.longest_chain(a_head.block_hashes + a_tail.block_hashes).num_present == 5
        assert catalog.longest_chain(b.block_hashes).num_present == 2
    finally:
        client.close()
        ray.kill(client.store)


def test_blocks_a_dead_store_cannot_take_are_counted_dropped(cluster, dsn):
    client = KVTierClient(KVTierConfig(enabled=True, dsn=dsn, capacity_bytes=64 << 20), MODEL, BS, DIM, coalesce_s=0.0)
    ray.kill(client.store, no_restart=True)
    tokens = list(range(5000, 5000 + 4 * BS))  # blocks the catalog does not hold (so the store is asked)
    stored = BlockStored(tuple(hash_blocks(tokens, BS, (MODEL, ""))), None, tuple(tokens), BS)
    try:
        pages = torch.randn(2, 4, BS, 3, 64).bfloat16()
        client.write(stored, "", pages, pages.clone())
        client.flush()  # returns: the writer thread lives on
        assert client.stats()["tier_dropped_blocks"] == 4 and client.stats()["tier_written_blocks"] == 0
    finally:
        client.close()
