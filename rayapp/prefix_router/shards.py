"""The application's PrefixIndex over its shards, as its users see it: one `match`, one `remove_replica`.

The index is split by replica, not by conversation: shard `shard_of(replica)` holds every block that replica
reports, so each shard absorbs the event streams of its share of the fleet and nothing else, a shared system
prompt costs each shard one copy instead of making one shard hot, and a replica's protocol (numbered
batches, snapshots) is with one actor. A routing decision asks every shard at once for its replicas'
holdings and merges them (each replica is in exactly one shard); the cluster tier's blocks, reported by
replicas of every shard, count as the longest run any shard knows.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rayapp.blocks import BlockHash
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import credit_cluster, prefix_index, shard_of
from rayapp.prefix_router.policy import Holding


class IndexShards:
    """Handles to every shard of one application's PrefixIndex."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    @classmethod
    def connect(cls, app_name: str, config: RouterConfig) -> IndexShards:
        """Every shard, created where missing. Blocks on the GCS: call it off the event loop."""
        return cls([prefix_index(app_name, config, shard) for shard in range(config.index_shards)])

    def of(self, replica: str) -> Any:
        """The shard indexing `replica`."""
        return self.handles[shard_of(replica, len(self.handles))]

    async def match(self, block_hashes: list[BlockHash], replicas: list[str]) -> dict[str, Holding]:
        """What `PrefixIndexService.match` answers, over all shards (each asked once, all at once)."""
        if len(self.handles) == 1:
            return await self.handles[0].match.remote(block_hashes, replicas)
        answers = await asyncio.gather(*(h.holdings.remote(block_hashes, replicas) for h in self.handles))
        held: dict[str, Holding] = {}
        for own, _ in answers:
            held.update(own)
        cluster = max((c for _, c in answers), key=lambda c: c.blocks)
        return credit_cluster(held, cluster, replicas)

    def remove_replica(self, replica: str) -> None:
        """Tell `replica`'s shard it is gone (fire and forget)."""
        self.of(replica).remove_replica.remote(replica)

    async def stats(self) -> dict[str, int]:
        """Blocks and replicas over all shards (a block two shards hold counts twice)."""
        answers = await asyncio.gather(*(h.stats.remote() for h in self.handles))
        return {key: sum(a[key] for a in answers) for key in ("blocks", "replicas")}
