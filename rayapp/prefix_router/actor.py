"""The PrefixIndex actor: one per application, fed by every replica's KV event batches; or `index_shards` of
them, each fed by the replicas that hash to it (`shard_of`) and asked together (`rayapp.prefix_router.shards`).

Protocol: each replica sends its events in order as numbered batches. Batch 0 is a snapshot
(it starts with `AllCleared`, replacing all the index knows of that replica); every later batch
must carry the next number. A gap (a lost batch) or a replica this actor does not know (it
restarted and lost its state) is answered False, and the replica resends a snapshot. A replica
that stops sending (not even its heartbeat) for `replica_timeout_s` is dropped.

Event batches and removals run in their own thread (the "events" concurrency group), matches and
stats in another, one lock between them: a routing decision waits for the batch being applied at
most, never for the queue of batches behind it (with 1,000 replicas publishing, that queue is long).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import ray

from rayapp.blocks import BlockHash, BlockRemoved, BlockStored, KVEvent, Tier
from rayapp.config import RouterConfig
from rayapp.prefix_router.index import PrefixIndex
from rayapp.prefix_router.policy import Holding

NAMESPACE = "rayapp"
# The pseudo-replica holding the blocks of the cluster KV tier: every replica can load them. Replicas
# announce the blocks they wrote there as `BlockStored(..., tier="cluster")`, and the blocks their node's
# store evicted or pruned as `BlockRemoved(..., tier="cluster")`. Tier blocks stay after the replica that
# wrote them leaves (a scaled-down replica's history stays loadable); those whose removal went unreported
# (a store that died with its node, a report lost with a batch) age out of the index by its LRU bound.
CLUSTER_HOLDER = "@cluster-tier"


def _is_cluster(event: KVEvent) -> bool:
    return isinstance(event, (BlockStored, BlockRemoved)) and event.tier == Tier.CLUSTER


def credit_cluster(held: dict[str, Holding], cluster: Holding, replicas: list[str]) -> dict[str, Holding]:
    """`held`, with the cluster tier's `cluster.blocks` credited to every replica as off-device (loadable)
    blocks past the ones it holds itself: both runs start at the first block, so together they cover the
    longer one."""
    if not cluster.blocks:
        return held
    held = dict(held)
    for r in replicas:
        own = held.get(r, Holding(0))
        if cluster.blocks > own.blocks:
            held[r] = Holding(cluster.blocks, own.offloaded + cluster.blocks - own.blocks)
    return held


class PrefixIndexService:
    """The actor's body (a plain class, so tests drive it without Ray). Thread-safe: one lock."""

    def __init__(self, max_blocks: int, replica_timeout_s: float, siblings: tuple[str, ...] = ()) -> None:
        self.index = PrefixIndex(max_blocks)
        self.replica_timeout_s = replica_timeout_s
        # The other shards' actor names: cluster-tier events reach every shard (the tier is every replica's).
        self._siblings = siblings
        self._sibling_handles: list[ray.actor.ActorHandle] = []
        self._next_batch: dict[str, int] = {}
        # Least recently heard first, so finding the silent ones costs nothing per call with 1,000 replicas.
        self._last_heard: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.RLock()

    @ray.method(concurrency_group="events")
    def publish(self, replica: str, batch: int, events: list[KVEvent]) -> bool:
        """Apply batch number `batch` of `replica`'s events; False: resend a snapshot as batch 0."""
        with self._lock:
            self._drop_silent()
            if batch != 0 and batch != self._next_batch.get(replica):
                self.remove_replica(replica)
                return False
            # Cluster-tier events, whichever replica reports them, change the one shared holder.
            self.index.apply(replica, [e for e in events if not _is_cluster(e)])
            cluster = [e for e in events if _is_cluster(e)]
            self.index.apply(CLUSTER_HOLDER, cluster)
            self._next_batch[replica] = batch + 1
            self._last_heard[replica] = time.monotonic()
            self._last_heard.move_to_end(replica)
        if cluster and self._siblings:
            self._forward(cluster)
        return True

    @ray.method(concurrency_group="events")
    def apply_cluster(self, events: list[KVEvent]) -> None:
        """Cluster-tier events another shard's replicas reported."""
        with self._lock:
            self.index.apply(CLUSTER_HOLDER, events)

    def _forward(self, events: list[KVEvent]) -> None:
        """Send cluster-tier events on to the other shards, without waiting: as unnumbered as the tier's reports
        are (a shard that misses some, restarting, ages those blocks out by its LRU bound)."""
        if len(self._sibling_handles) < len(self._siblings):  # a shard not created yet is looked up again next time
            self._sibling_handles = [h for h in map(_existing_actor, self._siblings) if h is not None]
        for handle in self._sibling_handles:
            handle.apply_cluster.remote(events)

    def match(self, block_hashes: list[BlockHash], replicas: list[str]) -> dict[str, Holding]:
        """Leading blocks of the request each of `replicas` holds (replicas holding none are absent), the
        cluster tier's blocks credited to each (`credit_cluster`)."""
        return credit_cluster(*self.holdings(block_hashes, replicas), replicas)

    def holdings(self, block_hashes: list[BlockHash], replicas: list[str]) -> tuple[dict[str, Holding], Holding]:
        """Leading blocks of the request each of `replicas` holds itself (replicas holding none are absent), and
        those the cluster tier holds (`Holding(0)`: none). A sharded index merges these over its shards."""
        with self._lock:
            self._drop_silent()
            overlaps = self.index.match(block_hashes)
        wanted = set(replicas)
        # Replicas with the same run share one Overlap (a system prompt's 1,000 holders): one Holding each.
        holdings: dict[int, Holding] = {}
        held = {}
        for r, o in overlaps.items():
            if r in wanted:
                holding = holdings.get(id(o))
                if holding is None:
                    holding = holdings[id(o)] = Holding(o.blocks, sum(t != Tier.DEVICE for t in o.tiers))
                held[r] = holding
        cluster = overlaps.get(CLUSTER_HOLDER)
        return held, Holding(cluster.blocks if cluster is not None else 0)

    @ray.method(concurrency_group="events")
    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it stopped, died, or must resend a snapshot)."""
        with self._lock:
            self.index.remove_replica(replica)
            self._next_batch.pop(replica, None)
            self._last_heard.pop(replica, None)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._drop_silent()
            return {"blocks": len(self.index), "replicas": len(self._next_batch)}

    def replicas(self) -> list[str]:
        """The replicas currently reporting."""
        with self._lock:
            self._drop_silent()
            return sorted(self._next_batch)

    def blocks(self, replica: str) -> list[BlockHash]:
        """The blocks the index says `replica` holds: what a check against the replica's own cache reads."""
        with self._lock:
            return self.index.blocks_of(replica)

    def _drop_silent(self) -> None:
        deadline = time.monotonic() - self.replica_timeout_s
        while self._last_heard and next(iter(self._last_heard.values())) < deadline:
            self.remove_replica(next(iter(self._last_heard)))


PrefixIndexActor = ray.remote(num_cpus=0, concurrency_groups={"events": 1})(PrefixIndexService)


def prefix_index(app_name: str, config: RouterConfig, shard: int = 0) -> ray.actor.ActorHandle:
    """Shard `shard` of the application's PrefixIndex (`config.index_shards` actors, each bounded at its share
    of `index_max_blocks`), created by whichever party asks first (the builder, normally).

    Detached and restarted by Ray if it dies: replicas then resend snapshots, routers fall back
    to power-of-two choices until it answers again. Blocks on the GCS: call it off the event loop.
    Refuses to run without Ray rather than start one (a router thread outliving `ray.shutdown` would).
    """
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: the PrefixIndex actor cannot be reached")
    if not 0 <= shard < config.index_shards:
        raise ValueError(f"shard {shard} of a PrefixIndex of {config.index_shards} shards")
    names = [_actor_name(app_name, i, config.index_shards) for i in range(config.index_shards)]
    return PrefixIndexActor.options(
        name=names[shard],
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        # Shards on as many nodes as there are (each one a process, its CPU its own); one index where Ray likes.
        scheduling_strategy="SPREAD" if config.index_shards > 1 else "DEFAULT",
    ).remote(
        -(-config.index_max_blocks // config.index_shards),
        config.replica_timeout_s,
        tuple(n for i, n in enumerate(names) if i != shard),
    )


def _existing_actor(name: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _actor_name(app_name: str, shard: int, shards: int) -> str:
    # A count of its own in a shard's name: an index of another count is another set of actors.
    return f"rayapp-prefix-index-{app_name}" + (f"-{shard}of{shards}" if shards > 1 else "")


def shard_of(replica: str, shards: int) -> int:
    """The shard that indexes `replica`'s blocks: the same in every process (not Python's salted `hash`)."""
    return int.from_bytes(hashlib.blake2b(replica.encode(), digest_size=8).digest(), "little") % shards
