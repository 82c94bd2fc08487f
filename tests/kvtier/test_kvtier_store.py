"""KVTierStore against a real embedded PostgreSQL: bytes and catalog rows stay in step."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import torch

from rayapp.blocks import BlockHash, hash_blocks
from rayapp.kvtier.catalog import BlockRow, Catalog, ChainMatch, TierUsage
from rayapp.kvtier.codec import KVBlock, decode_block, encode_block
from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database
from rayapp.kvtier.loader import load_chain
from rayapp.kvtier.postgres import EmbeddedPostgres, _free_port
from rayapp.kvtier.store import STORE_CONCURRENCY, KVTierStore, PutResult, get_or_create_store, store_name

DIM = 192  # the session catalog's representation size (tests/kvtier/conftest.py)
# A small page (2 layers, 16 tokens, 3 KV heads, 64 dims, bf16) keeps the object store light.
SHAPE = (2, 16, 3, 64)


def encoded_chain(n: int, salt: str = "t") -> list[bytes]:
    tokens = list(range(1000, 1000 + 16 * n))
    hashes = hash_blocks(tokens, 16, ("m", salt))
    g = torch.Generator().manual_seed(len(salt) + n)
    return [
        encode_block(
            KVBlock(h, hashes[i - 1] if i else None, tuple(tokens[16 * i : 16 * i + 16]), "m",
                    torch.randn(SHAPE, generator=g).bfloat16(), torch.randn(SHAPE, generator=g).bfloat16(), salt)
        )
        for i, h in enumerate(hashes)
    ]  # fmt: skip


def chain_hashes(n: int, salt: str = "t") -> list[BlockHash]:
    return hash_blocks(list(range(1000, 1000 + 16 * n)), 16, ("m", salt))


# Blocks differ by a few header bytes (a first block has no parent hash); capacities leave that slack.
BLOCK_BYTES = len(encoded_chain(1)[0])
SLACK = 100


def test_blocks_outlive_the_replica_that_wrote_them(cluster, catalog, dsn):
    store = get_or_create_store(dsn, DIM, 64 * BLOCK_BYTES)
    assert get_or_create_store(dsn, DIM, 1)._actor_id == store._actor_id
    hashes = chain_hashes(3, "outlive")

    @ray.remote(num_cpus=0)
    class Replica:
        def write(self, blocks: list[bytes]) -> list[bool]:
            # A separate process, like an LLMReplica: the store it writes to is looked up by name.
            named = ray.get_actor(store_name(ray.get_runtime_context().get_node_id()), namespace="rayapp")
            return ray.get(named.put_many.remote([np.frombuffer(b, np.uint8) for b in blocks])).kept

    replica = Replica.remote()
    blocks = encoded_chain(3, "outlive")
    assert ray.get(replica.write.remote(blocks)) == (True, True, True)
    ray.kill(replica)

    match = catalog.longest_chain(hashes)
    node_id = ray.get_runtime_context().get_node_id()
    assert match.num_present == 3 and {loc.store_name for loc in match.locations} == {store_name(node_id)}
    refs = ray.get(store.get_many.remote(hashes + [BlockHash(12345)]))
    assert refs[-1] is None
    for ref, data in zip(refs, blocks):
        back = decode_block(ray.get(ref))
        assert torch.equal(back.key.view(torch.int16), decode_block(data).key.view(torch.int16))
    stats = ray.get(store.stats.remote())
    assert (stats.num_blocks, stats.nbytes, stats.hits, stats.misses) == (3, sum(map(len, blocks)), 3, 1)
    assert ray.get(store.clear.remote()) == 3
    assert catalog.longest_chain(hashes) == ChainMatch()


def test_a_chain_loads_verified_from_the_stores(cluster, catalog, dsn):
    store = get_or_create_store(dsn, DIM, 64 * BLOCK_BYTES)
    tokens = list(range(1000, 1000 + 16 * 4))
    hashes = chain_hashes(4, "load")
    blocks = encoded_chain(4, "load")
    assert ray.get(store.put_many.remote(blocks)).kept == (True,) * 4
    match = catalog.longest_chain(hashes)
    loaded = load_chain(match, tokens, 16, ("m", "load"))
    assert [b.block_hash for b in loaded] == hashes
    assert all(torch.equal(a.value.view(torch.int16), decode_block(b).value.view(torch.int16))
               for a, b in zip(loaded, blocks))  # fmt: skip

    # A continuation after a local prefix hit: blocks 2.. with block 1 as their parent.
    rest = catalog.longest_chain(hashes[2:])
    assert len(load_chain(rest, tokens[32:], 16, ("m", "load"), parent=hashes[1])) == 2
    # Another tenant's hashes never verify, even if handed these locations.
    assert load_chain(match, tokens, 16, ("m", "other-tenant")) == []
    # Tokens that differ from the stored ones (a hash collision, in effect) end the chain there.
    assert len(load_chain(match, tokens[:40] + [7] * 24, 16, ("m", "load"))) == 2
    # A block evicted after the lookup, or a store that is gone, ends the chain before it.
    assert ray.get(store.delete.remote(hashes[3]))
    assert len(load_chain(match, tokens, 16, ("m", "load"))) == 3
    gone = ChainMatch(1, (dataclasses.replace(match.locations[0], store_name="rayapp-kvtier-store-gone"),))
    assert load_chain(gone, tokens, 16, ("m", "load")) == []
    ray.get(store.clear.remote())


def test_a_replica_reads_while_another_puts_a_history(cluster, catalog, dsn):
    @ray.remote(num_cpus=0)
    class Gate:
        """Holds a put inside its byte copy until the test opens it."""

        def __init__(self) -> None:
            self.entered, self.opened = asyncio.Event(), asyncio.Event()

        async def enter(self) -> None:
            self.entered.set()
            await self.opened.wait()

        async def wait_entered(self) -> None:
            await self.entered.wait()

        def open(self) -> None:
            self.opened.set()

    class SlowCopy(KVTierStore):
        def __init__(self, gate, *args) -> None:
            super().__init__(*args)
            self.gate = gate

        def _put_objects(self, arrays):
            if len(arrays) > 1:  # the history, not the single block stored first
                ray.get(self.gate.enter.remote())
            return super()._put_objects(arrays)

    gate = Gate.remote()
    store = ray.remote(SlowCopy).options(num_cpus=0, max_concurrency=STORE_CONCURRENCY).remote(gate, dsn, DIM, 1 << 20)
    held = encoded_chain(1, "held")
    assert ray.get(store.put_many.remote(held)).kept == (True,)
    pending = store.put_many.remote(encoded_chain(4, "history"))
    ray.get(gate.wait_entered.remote(), timeout=60)
    # The history's bytes are still being copied in: a read of another block is served meanwhile.
    (ref,) = ray.get(store.get_many.remote(chain_hashes(1, "held")), timeout=60)
    assert decode_block(ray.get(ref)).block_hash == chain_hashes(1, "held")[0]
    assert ray.wait([pending], timeout=0)[1] == [pending]
    assert catalog.longest_chain(chain_hashes(4, "history")).num_present == 0  # bytes first, rows after
    ray.get(gate.open.remote())
    assert ray.get(pending, timeout=60).kept == (True,) * 4
    assert catalog.longest_chain(chain_hashes(4, "history")).num_present == 4
    stats = ray.get(store.stats.remote())
    assert (stats.num_blocks, stats.nbytes) == (5, sum(map(len, held + encoded_chain(4, "history"))))
    ray.kill(store)


@pytest.fixture
def store(cluster, catalog, dsn) -> KVTierStore:
    """An in-process store (same code as the actor) of 3 blocks' capacity."""
    store = KVTierStore(dsn, DIM, 3 * BLOCK_BYTES + SLACK)
    yield store
    store.close()


def test_eviction_keeps_capacity_and_catalog_in_step(store, catalog):
    blocks = encoded_chain(5, "evict")
    hashes = chain_hashes(5, "evict")
    for data in reversed(blocks):  # one by one, tail first: the head is written last
        assert store.put(data)
    assert store.stats().nbytes == sum(map(len, blocks[:3]))
    assert catalog.usage() == catalog.usage(store.node_id) == TierUsage(3, store.stats().nbytes)
    assert set(store.held()) == set(hashes[:3])
    assert catalog.longest_chain(hashes).num_present == 3
    assert store.get_many(hashes[3:]) == [None, None]
    assert store.stats().evictions == 2


def test_a_recently_read_block_survives_eviction(store, catalog):
    a, b, c, d = (encoded_chain(1, salt) for salt in "abcd")
    for data in (a, b, c):
        assert store.put(data[0])
    assert store.get(chain_hashes(1, "a")[0]) is not None
    assert store.put(d[0])
    assert catalog.longest_chain(chain_hashes(1, "b")) == ChainMatch()
    for salt in "acd":
        assert catalog.longest_chain(chain_hashes(1, salt)).num_present == 1


def test_an_oversized_chain_keeps_its_head_and_evicts_tails_first(store, catalog):
    hashes = chain_hashes(5, "long")
    assert store.put_many(encoded_chain(5, "long")) == PutResult((True, True, True, False, False))
    assert catalog.longest_chain(hashes).num_present == 3
    # The chain's last held block went first: its first two blocks are still a usable prefix. The put
    # names it, as the engine hashes it, for the writer to announce to the prefix router.
    assert store.put_many(encoded_chain(1, "other")) == PutResult((True,), removed=(hashes[2],))
    assert catalog.longest_chain(hashes).num_present == 2
    assert store.stats().rejected_puts == 2


def test_every_block_that_left_the_tier_is_reported_once_unless_stored_here_again(store, catalog):
    a, b, c, d, e, f = (chain_hashes(1, salt)[0] for salt in "abcdef")
    for salt in "abc":
        assert store.put(encoded_chain(1, salt)[0])
    assert store.delete(a)
    assert store.put(encoded_chain(1, "d")[0])  # a single put leaves the report to the next put_many
    # Another store re-wrote c (on a live node, so no prune takes its row): c stays in the tier there.
    other = BlockRow(c, None, "m", "c", 0, store.node_id, "store-other", BLOCK_BYTES, 16)
    assert catalog.upsert([other])
    assert store.put_many(encoded_chain(1, "e")) == PutResult((True,), removed=(a, b))  # b evicted
    assert store.put_many(encoded_chain(1, "f")) == PutResult((True,))  # c evicted, but its row is not ours
    assert catalog.longest_chain([c]).locations[0].store_name == "store-other"
    assert store.delete(d)
    assert store.put_many(encoded_chain(1, "d")) == PutResult((True,))  # d is back before anyone heard it went
    assert set(store.held()) == {d, e, f}


def test_delete_drops_bytes_and_row(store, catalog):
    h = chain_hashes(1, "del")[0]
    assert store.put(encoded_chain(1, "del")[0], representation=np.ones(DIM, np.float32))
    assert catalog.topk_inner_product([h], np.ones(DIM), k=1)[0].score == pytest.approx(DIM)
    assert store.delete(h) and not store.delete(h)
    assert store.get(h) is None and catalog.usage() == TierUsage(0, 0)


def test_a_restarted_store_drops_the_rows_it_no_longer_backs(store, catalog, dsn):
    assert store.put_many(encoded_chain(2, "old")).kept == (True, True)
    KVTierStore(dsn, DIM, BLOCK_BYTES).close()  # the same node's store, started afresh
    assert catalog.usage() == TierUsage(0, 0)


@pytest.fixture
def private_database(tmp_path) -> EmbeddedPostgres:
    """A database of this test's own, on a fixed port so that a restart keeps its DSN."""
    db = EmbeddedPostgres(tmp_path / "db", port=_free_port("127.0.0.1"))
    yield db
    db.stop()


def test_database_down_disables_the_tier_once_and_calls_keep_working(cluster, private_database, caplog):
    db = private_database
    dsn = db.start()
    # The store as an actor, as replicas reach it, and in-process (where its log can be read).
    actor = ray.remote(KVTierStore).options(num_cpus=0).remote(dsn, DIM, 8 * BLOCK_BYTES, {"retry_after_s": 3600.0})
    assert ray.get(actor.put.remote(encoded_chain(1, "actor")[0]))
    # Two stores on one node break the one-per-node rule: this one's start wipes the actor's row, not its bytes.
    store = KVTierStore(dsn, DIM, 8 * BLOCK_BYTES, {"retry_after_s": 0.0, "connect_timeout_s": 2})
    lookup = Catalog(dsn, DIM, retry_after_s=3600.0)
    hashes = chain_hashes(2, "down")
    blocks = encoded_chain(2, "down")
    assert store.put(blocks[0])
    assert lookup.longest_chain(hashes).num_present == 1

    db.stop()
    assert ray.get(actor.put.remote(blocks[1])) is False
    assert ray.get(actor.get.remote(chain_hashes(1, "actor")[0])) is not None
    assert ray.get(actor.stats.remote()).catalog_available is False
    with caplog.at_level(logging.WARNING):
        assert store.put(blocks[1]) is False
        assert store.put_many(blocks).kept == (False, False)
        assert lookup.longest_chain(hashes) == ChainMatch()
        assert lookup.longest_chain(hashes) == ChainMatch()
        assert lookup.usage() == TierUsage()
        assert lookup.upsert([]) is False
        # Blocks already held are still served: their bytes do not depend on the database.
        assert store.get(hashes[0]) is not None
        assert store.stats().catalog_available is False
    ours = ("rayapp.kvtier", "psycopg", "psycopg.pool")
    warnings = [r for r in caplog.records if r.name in ours and r.levelno >= logging.WARNING]
    # One per catalog (the store's and the lookup's), however many calls failed, and none from the pool.
    assert [r.name for r in warnings] == ["rayapp.kvtier"] * 2, [r.getMessage() for r in warnings]
    assert "password" not in warnings[0].getMessage()

    assert db.start() == dsn  # back on the same port: the store (retry delay 0) reconnects
    assert store.put(blocks[1])
    assert lookup.longest_chain(hashes) == ChainMatch()  # still inside its hour-long retry delay
    store.close()


@pytest.fixture
def cluster_database(tmp_path):
    yield tmp_path / "cluster-db"
    stop_embedded_database()  # a no-op when the test stopped it already


def test_embedded_database_actor_starts_once_and_stops(cluster, cluster_database, tmp_path):
    with ThreadPoolExecutor(2) as pool:  # racing first callers share one actor and one server
        dsns = list(pool.map(start_embedded_database, [cluster_database] * 2))
    dsn = dsns[0]
    assert dsns[1] == dsn
    assert start_embedded_database(tmp_path / "ignored") == dsn
    assert not (tmp_path / "ignored").exists()
    catalog = Catalog(dsn, DIM)
    assert catalog.available and catalog.usage() == TierUsage()
    catalog.close()
    assert stop_embedded_database()
    assert not EmbeddedPostgres(cluster_database).is_running()
    assert not stop_embedded_database()


def test_embedded_database_stops_when_its_actor_dies(cluster, cluster_database):
    start_embedded_database(cluster_database)
    server = EmbeddedPostgres(cluster_database)
    assert server.is_running()
    # What happens to the actor when the cluster stops: its process is killed, no method runs.
    ray.kill(ray.get_actor("rayapp-kvtier-db", namespace="rayapp"), no_restart=True)
    deadline = time.monotonic() + 60
    while server.is_running():
        assert time.monotonic() < deadline, "the embedded database outlived its actor"
        time.sleep(0.2)
