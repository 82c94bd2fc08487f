"""A node dies: its catalog rows vanish within a prune period, with no store restarting, and a replica
asking for its blocks finds nothing and recomputes. Real embedded PostgreSQL, real store actors."""

from __future__ import annotations

import time

import pytest
import ray

from rayapp.engine.kv_events import hash_blocks
from rayapp.kvtier.catalog import BlockRow, ChainMatch, TierUsage
from rayapp.kvtier.store import KVTierStore, store_name

DIM = 192  # the session catalog's representation size (tests/kvtier/conftest.py)
# A node id Ray never knew (the hex of a real one is 56 digits): as good as a node that died.
DEAD_NODE = "de" * 28
PRUNE_PERIOD_S = 0.2


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False)
    yield
    ray.shutdown()


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
    ray.kill(store)
