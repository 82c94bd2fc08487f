"""A PrefixIndex split by replica over shards answers a routing decision as one index holding every replica would."""

from __future__ import annotations

import asyncio

from rayapp.blocks import AllCleared, BlockStored, Tier, hash_blocks
from rayapp.prefix_router.actor import PrefixIndexService, shard_of
from rayapp.prefix_router.policy import Holding
from rayapp.prefix_router.shards import IndexShards

BS = 4
TOKENS = list(range(48))
HASHES = hash_blocks(TOKENS, BS, ("m", ""))  # 12 blocks
REPLICAS = [f"replica-{i}" for i in range(9)]


def stored(end: int, tier: str = Tier.DEVICE) -> BlockStored:
    return BlockStored(tuple(HASHES[:end]), None, tuple(TOKENS[: end * BS]), BS, tier)


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        result = self.fn(*args)  # at once, as an actor applies a fire-and-forget call without being awaited

        async def answer():
            return result

        return answer()


class LocalHandle:
    """An in-process stand-in for a shard's actor handle."""

    def __init__(self, service: PrefixIndexService) -> None:
        self.service = service

    def __getattr__(self, name):
        return _Method(getattr(self.service, name))


def test_replicas_spread_over_the_shards_by_a_stable_hash():
    shards = [shard_of(r, 3) for r in REPLICAS]
    assert set(shards) == {0, 1, 2}
    assert shards == [shard_of(r, 3) for r in REPLICAS]


def test_a_sharded_index_answers_as_one_index_would():
    whole = PrefixIndexService(1000, 60.0)
    services = [PrefixIndexService(1000, 60.0) for _ in range(3)]
    shards = IndexShards([LocalHandle(s) for s in services])
    for i, replica in enumerate(REPLICAS):
        events = [AllCleared(), stored(i + 1)]
        if i == 4:  # one replica wrote 6 blocks to the cluster tier: they count for every replica
            events.append(stored(6, Tier.CLUSTER))
        whole.publish(replica, 0, events)
        services[shard_of(replica, 3)].publish(replica, 0, events)
    asked = [*REPLICAS, "replica-new"]
    expected = whole.match(HASHES, asked)
    assert expected["replica-8"] == Holding(9) and expected["replica-new"] == Holding(6, 6)
    assert asyncio.run(shards.match(HASHES, asked)) == expected
    assert asyncio.run(shards.match(HASHES, REPLICAS[:2])) == whole.match(HASHES, REPLICAS[:2])
    assert asyncio.run(shards.stats())["replicas"] == len(REPLICAS)


def test_a_replica_is_removed_from_its_own_shard():
    services = [PrefixIndexService(1000, 60.0) for _ in range(3)]
    shards = IndexShards([LocalHandle(s) for s in services])
    for replica in REPLICAS:
        shards.of(replica).service.publish(replica, 0, [AllCleared(), stored(3)])
    shards.remove_replica("replica-2")
    assert "replica-2" not in asyncio.run(shards.match(HASHES, REPLICAS))
    assert sorted(r for s in services for r in s.replicas()) == sorted(set(REPLICAS) - {"replica-2"})
