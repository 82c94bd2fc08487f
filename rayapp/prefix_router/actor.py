"""The PrefixIndex actor: one per application, fed by every replica's KV event batches.

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


class PrefixIndexService:
    """The actor's body (a plain class, so tests drive it without Ray). Thread-safe: one lock."""

    def __init__(self, max_blocks: int, replica_timeout_s: float) -> None:
        self.index = PrefixIndex(max_blocks)
        self.replica_timeout_s = replica_timeout_s
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
            self.index.apply(CLUSTER_HOLDER, [e for e in events if _is_cluster(e)])
            self._next_batch[replica] = batch + 1
            self._last_heard[replica] = time.monotonic()
            self._last_heard.move_to_end(replica)
            return True

    def match(self, block_hashes: list[BlockHash], replicas: list[str]) -> dict[str, Holding]:
        """Leading blocks of the request each of `replicas` holds (replicas holding none are absent).

        Blocks in the cluster tier count for every replica, as off-device (loadable) blocks past the ones
        it holds itself: both runs start at the first block, so together they cover the longer one.
        """
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
        if cluster is None:
            return held
        for r in replicas:
            own = held.get(r, Holding(0))
            if cluster.blocks > own.blocks:
                held[r] = Holding(cluster.blocks, own.offloaded + cluster.blocks - own.blocks)
        return held

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

    def _drop_silent(self) -> None:
        deadline = time.monotonic() - self.replica_timeout_s
        while self._last_heard and next(iter(self._last_heard.values())) < deadline:
            self.remove_replica(next(iter(self._last_heard)))


PrefixIndexActor = ray.remote(num_cpus=0, concurrency_groups={"events": 1})(PrefixIndexService)


def prefix_index(app_name: str, config: RouterConfig) -> ray.actor.ActorHandle:
    """The application's PrefixIndex actor, created by whichever party asks first (the builder, normally).

    Detached and restarted by Ray if it dies: replicas then resend snapshots, routers fall back
    to power-of-two choices until it answers again. Blocks on the GCS: call it off the event loop.
    Refuses to run without Ray rather than start one (a router thread outliving `ray.shutdown` would).
    """
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: the PrefixIndex actor cannot be reached")
    return PrefixIndexActor.options(
        name=f"rayapp-prefix-index-{app_name}",
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
    ).remote(config.index_max_blocks, config.replica_timeout_s)
