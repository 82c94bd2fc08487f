"""The PrefixIndex actors in Ray: a routing decision is answered beside the queue of event batches, not behind it;
shards are actors of their own, each bounded at its share, and the cluster tier's blocks reach all of them."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from rayapp.blocks import AllCleared, BlockStored, Tier
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import prefix_index, shard_of
from rayapp.prefix_router.policy import Holding
from rayapp.prefix_router.shards import IndexShards

pytestmark = pytest.mark.slow  # a Ray cluster


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_a_decision_does_not_wait_for_the_queue_of_event_batches():
    rng = random.Random(0)
    prompt = [rng.getrandbits(64) for _ in range(8)]
    # 30 batches of 20K blocks each (a fleet's burst: hundreds of replicas publishing at once).
    batches = [[AllCleared(), BlockStored(tuple(prompt), None, (), 16)]] + [
        [BlockStored(tuple(rng.getrandbits(64) for _ in range(200)), None, (), 16) for _ in range(100)]
        for _ in range(30)
    ]
    index = prefix_index("actor-test", RouterConfig(index_max_blocks=1_000_000, replica_timeout_s=600))
    ray.get(index.stats.remote())  # started
    queued = [index.publish.remote("r", batch, events) for batch, events in enumerate(batches)]
    assert ray.get(index.match.remote(prompt, ["r"])) == {"r": Holding(8)}
    applied, _ = ray.wait(queued, num_returns=len(queued), timeout=0)
    assert len(applied) < len(queued) // 2  # the match did not queue behind the batches
    assert all(ray.get(queued)) and ray.get(index.stats.remote())["blocks"] == 8 + 30 * 20_000
    ray.kill(index)


def test_shards_are_bounded_at_their_share_and_all_learn_the_cluster_tier():
    rng = random.Random(1)
    config = RouterConfig(index_shards=3, index_max_blocks=300, replica_timeout_s=600)
    shards = IndexShards.connect("shard-test", config)
    assert len({handle._actor_id for handle in shards.handles}) == 3
    # Two replicas of different shards: one fills its shard past its share (100 blocks), one writes to the tier.
    names = [f"replica-{i}" for i in range(99)]
    first = next(r for r in names if shard_of(r, 3) == 0)
    second = next(r for r in names if shard_of(r, 3) != 0)
    chain = tuple(rng.getrandbits(64) for _ in range(250))
    assert ray.get(shards.of(first).publish.remote(first, 0, [AllCleared(), BlockStored(chain, None, (), 16)]))
    assert ray.get(shards.handles[0].stats.remote())["blocks"] == 100
    tier = tuple(rng.getrandbits(64) for _ in range(5))
    events = [AllCleared(), BlockStored(tier, None, (), 16, Tier.CLUSTER)]
    assert ray.get(shards.of(second).publish.remote(second, 0, events))
    deadline = time.monotonic() + 30
    while ray.get([h.holdings.remote(list(tier), []) for h in shards.handles]) != [({}, Holding(5))] * 3:
        assert time.monotonic() < deadline, "the cluster tier's blocks did not reach every shard"
        time.sleep(0.1)
    assert asyncio.run(shards.match(list(tier), ["anyone"])) == {"anyone": Holding(5, 5)}
    for handle in shards.handles:
        ray.kill(handle)
