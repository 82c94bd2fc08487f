"""Blocks leave the cluster tier, and the prefix router hears of it.

A node dies: its catalog rows vanish within a prune period, with no store restarting, and a replica
asking for its blocks finds nothing and recomputes; one that still finds a row meets a dead store,
which is a miss too. A store evicts: the replica whose write caused it
announces the evicted blocks, and the PrefixIndex stops crediting them. Real embedded PostgreSQL, real
store actors, a real `KVTierClient`.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import ray
import torch

from rayapp.blocks import AllCleared, BlockRemoved, BlockStored, Tier, hash_blocks
from rayapp.config import KVTierConfig
from rayapp.kvtier import loader
from rayapp.kvtier.catalog import BlockLocation, BlockRow, ChainMatch, TierUsage
from rayapp.kvtier.client import KVTierClient
from rayapp.kvtier.codec import KVBlock, encode_block
from rayapp.kvtier.loader import load_chain
from rayapp.kvtier.store import KVTierStore, get_or_create_store, store_name
from rayapp.prefix_router.actor import PrefixIndexService
from rayapp.prefix_router.policy import Holding

DIM = 192  # the session catalog's representation size (tests/kvtier/conftest.py)
# A node id Ray never knew (the hex of a real one is 56 digits): as good as a node that died.
DEAD_NODE = "de" * 28
PRUNE_PERIOD_S = 0.2


def rows(salt: str, node_id: str) -> list[BlockRow]:
    """Catalog rows of a 3-block chain held by `node_id`'s store."""
    hashes = hash_blocks(list(range(48)), 16, ("m", salt))
    return [
        BlockRow(h, hashes[i - 1] if i else None, "m", salt, 0, node_id, store_name(node_id), 1000, 16)
        for i, h in enumerate(hashes)
    ]


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_rows_of_a_dead_node_vanish_within_a_prune_period(cluster, catalog, dsn):
    store = ray.remote(KVTierStore).options(num_cpus=0).remote(dsn, DIM, 1 << 20, None, PRUNE_PERIOD_S)
    node_id = ray.get(store.stats.remote()).node_id  # started: its startup cleanup is behind us
    live, dead = rows("live", node_id), rows("dead", DEAD_NODE)
    assert catalog.upsert(live + dead)
    dead_hashes = [row.block_hash for row in dead]
    assert catalog.longest_chain(dead_hashes).num_present == 3

    # Well within the period (x 25 for a loaded machine), and with no store starting meanwhile.
    wait_until(lambda: catalog.usage(DEAD_NODE) == TierUsage(), 25 * PRUNE_PERIOD_S, "the dead node's rows stayed")
    # A replica asking now gets no row pointing at the dead node's store: it recomputes those blocks.
    assert catalog.longest_chain(dead_hashes) == ChainMatch()
    assert catalog.longest_chain([row.block_hash for row in live]).num_present == 3
    assert catalog.usage() == TierUsage(3, 3000)
    # The store that pruned them reports them with its next put, for the router's index.
    assert set(ray.get(store.put_many.remote([])).removed) == set(dead_hashes)
    ray.kill(store)


def test_a_store_whose_node_died_is_a_miss_never_an_error(cluster, catalog, dsn, monkeypatch):
    # The dead node's store as a replica may have looked it up just before: pinned to a node that is gone.
    gone = get_or_create_store(dsn, DIM, 1 << 20, node_id=DEAD_NODE)
    with pytest.raises(ray.exceptions.ActorUnschedulableError):
        ray.get(gone.stats.remote())
    dead = rows("dead", DEAD_NODE)
    match = ChainMatch(3, tuple(BlockLocation(r.block_hash, 0, DEAD_NODE, r.store_name, 1000, 16) for r in dead))
    tokens = list(range(48))
    assert load_chain(match, tokens, 16, ("m", "dead")) == []  # looked up now: no such actor
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: gone)
    assert load_chain(match, tokens, 16, ("m", "dead")) == []  # looked up before: its calls fail


@ray.remote(num_cpus=0)
class SilentStore:
    """A store on a node cut off from the cluster: calls reach it and never come back."""

    def get_many(self, block_hashes, layer_group=0):
        time.sleep(3600)


def test_a_store_that_does_not_answer_is_a_miss_after_the_load_timeout(cluster, monkeypatch):
    silent = SilentStore.remote()
    monkeypatch.setattr(loader, "LOAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: silent)
    dead = rows("cut", DEAD_NODE)
    match = ChainMatch(3, tuple(BlockLocation(r.block_hash, 0, DEAD_NODE, r.store_name, 1000, 16) for r in dead))
    assert load_chain(match, list(range(48)), 16, ("m", "cut")) == []
    ray.kill(silent)


# The client's blocks: 2 layers, 16 tokens, 3 KV heads of 64 dims, bf16 (SmolLM2's heads, fewer layers).
BS = 16
MODEL = "m"


def cached_run(salt: str, num_blocks: int) -> tuple[BlockStored, torch.Tensor]:
    """A run of blocks as the engine caches them (a device BlockStored), with their K/V pages."""
    tokens = list(range(1000, 1000 + BS * num_blocks))
    hashes = hash_blocks(tokens, BS, (MODEL, salt))
    pages = torch.randn(2, num_blocks, BS, 3, 64, generator=torch.Generator().manual_seed(num_blocks)).bfloat16()
    return BlockStored(tuple(hashes), None, tuple(tokens), BS), pages


def block_bytes() -> int:
    stored, pages = cached_run("size", 2)
    h = stored.block_hashes
    return len(encode_block(KVBlock(h[1], h[0], stored.token_ids[BS:], MODEL, pages[:, 1], pages[:, 1], "size")))


@pytest.fixture
def client(cluster, catalog, dsn):
    """A replica's tier client whose node store (created by it) holds 3 blocks."""
    config = KVTierConfig(enabled=True, dsn=dsn, capacity_bytes=3 * block_bytes() + 100)
    client = KVTierClient(config, MODEL, BS, DIM)
    yield client
    client.close()
    ray.kill(client.store)


def write(client: KVTierClient, salt: str, num_blocks: int) -> BlockStored:
    stored, pages = cached_run(salt, num_blocks)
    client.write(stored, salt, pages, pages)
    client.flush()
    return stored


def test_blocks_the_store_evicts_are_announced_and_leave_the_routers_index(client):
    a = write(client, "a", 3)
    assert client.take_events() == [dataclasses.replace(a, tier=Tier.CLUSTER)]
    b = write(client, "b", 2)
    # B needed room: the store evicted A's last two blocks (a chain's tail goes first) and said so.
    removed, stored = client.take_events()
    assert isinstance(removed, BlockRemoved) and removed.tier == Tier.CLUSTER
    assert set(removed.block_hashes) == set(a.block_hashes[1:])
    assert stored == dataclasses.replace(b, tier=Tier.CLUSTER)

    index = PrefixIndexService(max_blocks=100, replica_timeout_s=60)
    assert index.publish("r", 0, [AllCleared(), dataclasses.replace(a, tier=Tier.CLUSTER), removed, stored])
    # Every replica can load A's first block and all of B from the tier, and nothing more.
    assert index.match(list(a.block_hashes), ["r", "s"]) == {"r": Holding(1, 1), "s": Holding(1, 1)}
    assert index.match(list(b.block_hashes), ["s"]) == {"s": Holding(2, 2)}

    # The engine caches A again: its evicted blocks are written again, not skipped as already sent.
    written, skipped = client.counters["written_blocks"], client.counters["skipped_blocks"]
    write(client, "a", 3)
    assert client.counters["written_blocks"] == written + 2
    assert client.counters["skipped_blocks"] == skipped + 1  # block 0, still in the tier
    assert client.take_events()[-1].block_hashes == a.block_hashes[1:]
