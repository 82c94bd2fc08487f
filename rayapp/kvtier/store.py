"""`KVTierStore`: the per-node Ray actor that owns cluster-tier blocks in the object store.

A replica hands the store encoded blocks (`codec.encode_block`); the store `ray.put`s them itself,
so the objects are owned by the store and outlive the replica that produced them (an object dies
with its owner). Each stored block has one catalog row naming this store; the store keeps a byte
capacity and evicts least recently used blocks, deleting their rows in the same call.

Contract for readers: `get` returns the block's ObjectRef. Holding the ref keeps the bytes alive
even if the store evicts the block meanwhile, so a reader never loses a block it is loading.

When the catalog database is unreachable the store refuses new blocks (`put` returns False, once
warned about by the catalog) and still serves the blocks it holds.

The actor serves calls concurrently (`STORE_CONCURRENCY` threads): copying a history's bytes into the
object store takes a large `put_many` a good part of a second, and a replica's `get_many` must not wait
behind it. One lock guards the store's state; the bytes are copied outside it.

A node that dies takes its blocks with it: every store deletes the rows of dead nodes when it starts
and then every `PRUNE_PERIOD_S`, on a thread of its own. Blocks whose rows a store removed (evicted,
deleted, or of a dead node) leave the tier; `put_many` hands them to the writing replica, which
announces them to the prefix router as `BlockRemoved(..., tier="cluster")`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayapp.blocks import BlockHash
from rayapp.kvtier.catalog import BlockRow, Catalog
from rayapp.kvtier.codec import decode_header
from rayapp.kvtier.embedded import NAMESPACE
from rayapp.kvtier.records import BlockKey

logger = logging.getLogger("rayapp.kvtier")

STORE_NAME_PREFIX = "rayapp-kvtier-store-"
# How often each store deletes the rows of dead nodes. Until they go, replicas find those rows, ask a
# store that is gone (a miss: they recompute) and the router counts the blocks as loadable. Ray takes
# seconds to declare a node dead, so a much shorter period buys little; a prune is one DELETE per store.
PRUNE_PERIOD_S = 10.0
# Removed blocks kept for the next `put_many`, at most: past it the oldest go unreported (the prefix
# index then keeps crediting them until its own LRU bound drops them).
_MAX_PENDING_REMOVALS = 1 << 16
# Calls a store actor serves at once: the gets of loading replicas while puts copy bytes in.
STORE_CONCURRENCY = 8

Representation = Sequence[float] | np.ndarray | None


def store_name(node_id: str) -> str:
    """The actor name of the store on node `node_id` (also the `store_name` of its catalog rows)."""
    return STORE_NAME_PREFIX + node_id


def alive_node_ids() -> list[str]:
    """Ids of the cluster's live nodes."""
    return [node["NodeID"] for node in ray.nodes() if node["Alive"]]


@dataclass(frozen=True)
class StoreStats:
    node_id: str
    store_name: str
    num_blocks: int
    nbytes: int
    capacity_bytes: int
    puts: int
    # Puts refused: catalog unreachable, or a block larger than the whole capacity.
    rejected_puts: int
    hits: int
    misses: int
    evictions: int
    catalog_available: bool


def _as_uint8(data: bytes | np.ndarray) -> np.ndarray:
    return data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)


@dataclass(frozen=True)
class PutResult:
    """What `put_many` did: per block, whether it is now held (`kept`); and the blocks that left the
    tier through this store since its last `put_many` (`removed`: evicted, deleted, or rows of dead
    nodes it pruned), as the engine's block hashes, for the writer to announce to the prefix router."""

    kept: tuple[bool, ...]
    removed: tuple[BlockHash, ...] = ()


@dataclass(slots=True)
class _Entry:
    ref: ray.ObjectRef
    nbytes: int


class KVTierStore:
    """Blocks of one node, LRU within `capacity_bytes`, catalogued in the database at `dsn`.

    Meant to run as the named actor `get_or_create_store` makes; its methods are its actor API.
    A fresh store deletes the rows its node left behind (a restarted store holds nothing) and
    those of nodes no longer alive, which it then does again every `prune_period_s`.
    """

    def __init__(
        self,
        dsn: str,
        representation_dim: int,
        capacity_bytes: int,
        catalog_options: dict[str, Any] | None = None,
        prune_period_s: float = PRUNE_PERIOD_S,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 1")
        if prune_period_s <= 0:
            raise ValueError(f"prune_period_s={prune_period_s} must be > 0")
        self.node_id = ray.get_runtime_context().get_node_id()
        self.name = store_name(self.node_id)
        self.capacity_bytes = capacity_bytes
        self._catalog = Catalog(dsn, representation_dim, **(catalog_options or {}))
        # Key (block hash, layer group); order: least recently used first.
        self._blocks: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._nbytes = 0
        self._puts = self._rejected = self._hits = self._misses = self._evictions = 0
        # Guards the blocks, their bytes and the counters: the actor runs calls on several threads.
        self._lock = threading.Lock()
        # Keys whose rows this store removed, oldest first, until a `put_many` reports them. The
        # pruning thread adds to it too, hence a lock of its own.
        self._removed: OrderedDict[BlockKey, None] = OrderedDict()
        self._removed_lock = threading.Lock()
        self._note_removed(self._catalog.remove_node(self.node_id))
        self.prune_dead_nodes()
        self._closed = threading.Event()
        self._pruner = threading.Thread(
            target=self._prune_loop, args=(prune_period_s,), name="rayapp-kvtier-pruner", daemon=True
        )
        self._pruner.start()

    def put(self, data: bytes | np.ndarray, representation: Representation = None) -> bool:
        """Store one encoded block; True once it is held and catalogued. See `put_many` (the blocks
        removed meanwhile stay for the next `put_many` to report)."""
        return self._put_chain([data], [representation])[0]

    def put_many(
        self, blocks: Sequence[bytes | np.ndarray], representations: Sequence[Representation] | None = None
    ) -> PutResult:
        """Store encoded blocks, evicting LRU blocks to make room, and upsert their rows in one batch.

        Pass numpy uint8 arrays rather than bytes to spare a copy on the way in. `blocks` is taken
        as a chain in token order: when they do not all fit, the earlier ones are kept (a block is
        useless without those before it), and the later ones count as less recently used. A block
        already held is not copied again: it becomes recently used and its row is refreshed.
        `kept` is all False (nothing kept) when the catalog is unreachable; `removed` names the
        blocks that left the tier through this store since its last `put_many` (any caller's), those
        this call evicted included. Malformed bytes raise `BlockFormatError`.
        """
        kept = self._put_chain(blocks, representations)
        return PutResult(tuple(kept), self._take_removed())

    def _put_chain(
        self, blocks: Sequence[bytes | np.ndarray], representations: Sequence[Representation] | None
    ) -> list[bool]:
        if representations is None:
            representations = [None] * len(blocks)
        if len(representations) != len(blocks):
            raise ValueError(f"{len(representations)} representations for {len(blocks)} blocks")
        headers = [decode_header(data) for data in blocks]
        if not self._catalog.available:
            with self._lock:
                self._rejected += len(blocks)
            return [False] * len(blocks)
        keys = [(h.block_hash, h.layer_group) for h in headers]
        arrays = [_as_uint8(data) for data in blocks]
        with self._lock:
            held = {key for key in keys if key in self._blocks}
            budget = self.capacity_bytes - sum(self._blocks[key].nbytes for key in held)
        admitted: dict[tuple[int, int], np.ndarray] = {}
        for key, array in zip(keys, arrays):
            if key not in held and key not in admitted and array.nbytes <= budget:
                admitted[key] = array
                budget -= array.nbytes
        # The slow part, outside the lock. The bytes go in before their rows, so a row never names bytes
        # that were never there.
        entries = self._put_objects(admitted)
        with self._lock:
            # Another call may have evicted or stored some of these blocks meanwhile: rows are written for
            # what the store holds once this call is done.
            present = {key for key in keys if key in self._blocks or key in entries}
        rows = [
            BlockRow(
                block_hash=h.block_hash, parent_hash=h.parent_hash, model_id=h.model_id,
                cache_salt=h.cache_salt, layer_group=h.layer_group, node_id=self.node_id,
                store_name=self.name, nbytes=array.nbytes, num_tokens=len(h.token_ids), representation=rep,
            )
            for h, key, array, rep in zip(headers, keys, arrays, representations)
            if key in present
        ]  # fmt: skip
        # Database I/O outside the lock: a slow or silent database must not stall the store's other calls.
        if not self._catalog.upsert(rows):
            with self._lock:
                self._rejected += len(blocks)
            return [False] * len(blocks)
        with self._lock:
            for key in reversed(keys):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
            new = {key: entry for key, entry in entries.items() if key not in self._blocks}
            # Only blocks outside this batch are evicted: `budget` kept the batch within the capacity.
            gone = self._evict(self._nbytes + sum(e.nbytes for e in new.values()) - self.capacity_bytes)
            for key in reversed(keys):  # the chain's head ends most recently used
                if key in new:
                    self._blocks[key] = new.pop(key)
                    self._nbytes += self._blocks[key].nbytes
            kept = [key in self._blocks for key in keys]
            self._puts += sum(kept)
            self._rejected += len(kept) - sum(kept)
            # Rows just written for blocks another call evicted during the upsert: they go with the evicted ones.
            gone += [key for key in present if key not in self._blocks]
        self._remove_rows(gone)
        return kept

    def _put_objects(self, arrays: dict[tuple[int, int], np.ndarray]) -> dict[tuple[int, int], _Entry]:
        """Copy blocks' bytes into the object store, owned by this actor (no lock held: it is the slow part)."""
        return {key: _Entry(ray.put(array), array.nbytes) for key, array in arrays.items()}

    def _evict(self, nbytes: int) -> list[tuple[int, int]]:
        """Drop least recently used blocks until `nbytes` are freed (lock held); returns their keys, whose rows
        the caller removes once it released the lock."""
        evicted = []
        while nbytes > 0 and self._blocks:
            key, entry = self._blocks.popitem(last=False)
            self._nbytes -= entry.nbytes
            nbytes -= entry.nbytes
            self._evictions += 1
            evicted.append(key)
        return evicted

    def _remove_rows(self, keys: Sequence[tuple[int, int]]) -> None:
        """Delete the rows of blocks this store no longer holds (lock not held).

        Only the rows still naming this store count as removed: a block another store re-wrote
        meanwhile stays in the tier there."""
        by_group: dict[int, list[int]] = {}
        for block_hash, layer_group in dict.fromkeys(keys):
            by_group.setdefault(layer_group, []).append(block_hash)
        for layer_group, hashes in by_group.items():
            self._note_removed(self._catalog.remove(hashes, layer_group, node_id=self.node_id, store_name=self.name))

    def get(self, block_hash: int, layer_group: int = 0) -> ray.ObjectRef | None:
        """The ObjectRef of a held block (a numpy uint8 array of its encoded bytes), or None."""
        return self.get_many([block_hash], layer_group)[0]

    def get_many(self, block_hashes: Sequence[int], layer_group: int = 0) -> list[ray.ObjectRef | None]:
        """ObjectRefs of the held blocks among `block_hashes` (None where missing), in order.

        Hits become most recently used here and in the catalog (`last_used`), in one statement.
        """
        refs: list[ray.ObjectRef | None] = []
        hit: list[int] = []
        with self._lock:
            for block_hash in block_hashes:
                entry = self._blocks.get((block_hash, layer_group))
                refs.append(None if entry is None else entry.ref)
                if entry is not None:
                    hit.append(block_hash)
            self._hits += len(hit)
            self._misses += len(refs) - len(hit)
            for block_hash in reversed(hit):  # as in put_many: earlier blocks of a chain end more recently used
                self._blocks.move_to_end((block_hash, layer_group))
        if hit:
            self._catalog.touch(hit, layer_group)
        return refs

    def delete(self, block_hash: int, layer_group: int = 0) -> bool:
        """Drop a held block and its row; False if it was not held."""
        with self._lock:
            entry = self._blocks.pop((block_hash, layer_group), None)
            if entry is None:
                return False
            self._nbytes -= entry.nbytes
        self._remove_rows([(block_hash, layer_group)])
        return True

    def clear(self) -> int:
        """Drop every block and this node's rows (before the store is shut down); returns how many blocks."""
        with self._lock:
            count = len(self._blocks)
            self._blocks.clear()
            self._nbytes = 0
        self._note_removed(self._catalog.remove_node(self.node_id))
        return count

    def close(self) -> None:
        """Stop the pruning thread and close the catalog's connections. An actor's end does both; an
        in-process store (tests) calls this."""
        self._closed.set()
        self._pruner.join()
        self._catalog.close()

    def held(self, layer_group: int = 0) -> list[BlockHash]:
        """Hashes of the held blocks of a layer group, least recently used first."""
        with self._lock:
            return [BlockHash(h) for h, group in self._blocks if group == layer_group]

    def prune_dead_nodes(self) -> int:
        """Delete the catalog rows of nodes that are no longer alive; returns how many went."""
        removed = self._catalog.remove_nodes_except(alive_node_ids())
        self._note_removed(removed)
        return len(removed)

    def _prune_loop(self, period_s: float) -> None:
        while not self._closed.wait(period_s):
            try:
                self.prune_dead_nodes()
            except Exception:  # the GCS briefly unreachable, say: the next period tries again
                logger.exception("cluster KV tier: pruning the rows of dead nodes failed")

    def _note_removed(self, keys: Sequence[BlockKey]) -> None:
        with self._removed_lock:
            for key in keys:
                self._removed[key] = None
                self._removed.move_to_end(key)
            while len(self._removed) > _MAX_PENDING_REMOVALS:
                self._removed.popitem(last=False)

    def _take_removed(self) -> tuple[BlockHash, ...]:
        with self._removed_lock:
            keys, self._removed = self._removed, OrderedDict()
        # A block written here again since its row went is in the tier: not removed. Without its
        # layer group a block cannot be loaded whole, so one group's row going removes the block.
        with self._lock:
            return tuple(dict.fromkeys(BlockHash(h) for h, group in keys if (h, group) not in self._blocks))

    def stats(self) -> StoreStats:
        """Counters and occupancy of this store."""
        available = self._catalog.available  # may try to reconnect: not while holding the lock
        with self._lock:
            return StoreStats(
                node_id=self.node_id, store_name=self.name, num_blocks=len(self._blocks), nbytes=self._nbytes,
                capacity_bytes=self.capacity_bytes, puts=self._puts, rejected_puts=self._rejected, hits=self._hits,
                misses=self._misses, evictions=self._evictions, catalog_available=available,
            )  # fmt: skip


def get_or_create_store(
    dsn: str,
    representation_dim: int,
    capacity_bytes: int,
    *,
    node_id: str | None = None,
    catalog_options: dict[str, Any] | None = None,
) -> ray.actor.ActorHandle:
    """The store actor of `node_id` (default: the caller's node), created pinned to that node if missing.

    Race-safe: concurrent callers get the same actor. The first caller's arguments win.
    """
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return (
        ray.remote(KVTierStore)
        .options(
            name=store_name(node_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            max_concurrency=STORE_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(dsn, representation_dim, capacity_bytes, catalog_options)
    )
