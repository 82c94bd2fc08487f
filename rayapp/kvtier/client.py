"""`KVTierClient`: one engine's side of the cluster tier (the `TierPort` of `rayapp.kvtier.connector`).

Writes go through a queue to one background thread: the engine thread only copies pages and enqueues.
The thread takes the runs queued within `COALESCE_S` of the first as one batch, skips blocks the
catalog already has (one query), encodes the rest and hands them to the node's `KVTierStore` in one
`put_many`. Batching is what keeps the tier cheap: each call costs the engine, the store and the raylet
milliseconds of CPU whatever its size, and decode fills a block per sequence every few steps.

What the tier gained and lost through those puts is kept as events for the prefix router
(`take_events`): the blocks written, and the blocks the store reports gone (evicted for room, or rows
of a dead node it pruned). Reads (`fetch`) ask the catalog for the longest stored continuation of a
prompt's hash chain and load it through `loader.load_chain`, which verifies every block (hash, parent,
token ids, tenant) before the engine sees it.

The tier never fails a request: with the database unreachable the catalog disables itself with one
warning, `fetch` returns nothing (the engine recomputes) and writes are dropped; a store or object
that is gone ends a load early, the same way.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from rayapp.blocks import BlockHash, BlockRemoved, BlockStored, Tier
from rayapp.config import KVTierConfig
from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.codec import KVBlock, encode_block
from rayapp.kvtier.connector import connect
from rayapp.kvtier.embedded import start_embedded_database
from rayapp.kvtier.loader import load_chain
from rayapp.kvtier.records import ChainMatch
from rayapp.kvtier.store import get_or_create_store
from rayapp.observability import Metric, counters

if TYPE_CHECKING:
    from rayapp.engine.llm_engine import LLMEngine

logger = logging.getLogger("rayapp.kvtier")

METRICS = counters(
    {
        "tier_written_blocks": "Blocks this engine wrote to the cluster KV tier",
        "tier_skipped_blocks": "Blocks not written because the tier already held them",
        "tier_dropped_blocks": "Blocks not written: the writer was too far behind, or the node's store was restarting",
        "tier_loaded_blocks": "Blocks this engine loaded from the cluster KV tier",
        "tier_write_batches": "Calls that handed blocks to the node's tier store (runs queued together share one)",
    }
)
# Copied pages waiting for the writer thread, at most: past it new blocks are not written (the tier is a
# cache; an engine must not grow without bound because the object store or the database is slow).
MAX_PENDING_BYTES = 512 << 20
# How long the writer waits for more runs after the first of a batch (so a block reaches the tier up to this much
# later), and the most bytes of pages it takes into one. What batching saves: bench/kvtier_writes.py.
COALESCE_S = 0.1
MAX_BATCH_BYTES = 64 << 20
# Hashes this client wrote recently, so a block cached again locally (after eviction) is not re-sent.
_REMEMBERED_WRITES = 1 << 16


class KVTierClient:
    """Connects one engine to the cluster tier: the catalog at `config.dsn` (or the embedded database,
    started once per cluster when `dsn` is unset) and the store actor of node `node_id` (None: the node this
    process joined Ray through). Needs Ray initialized. `coalesce_s` and `max_batch_bytes` bound the writer's
    batches (`max_batch_bytes=1`: one run per batch)."""

    def __init__(
        self,
        config: KVTierConfig,
        model_id: str,
        block_size: int,
        representation_dim: int,
        *,
        coalesce_s: float = COALESCE_S,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        node_id: str | None = None,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("the cluster KV tier needs Ray: call ray.init() first (the offline LLM does)")
        self.config = config
        self.model_id = model_id
        self.block_size = block_size
        self.min_load_tokens = config.min_load_tokens
        self.coalesce_s, self.max_batch_bytes = coalesce_s, max_batch_bytes
        self.dsn = config.dsn or start_embedded_database(config.data_dir)
        self.catalog = Catalog(self.dsn, representation_dim)
        self.store = get_or_create_store(self.dsn, representation_dim, config.capacity_bytes, node_id=node_id)
        self._queue: queue.Queue[_Run | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._events: list[BlockStored | BlockRemoved] = []
        self._written: OrderedDict[BlockHash, None] = OrderedDict()
        self.counters = dict.fromkeys(
            ("written_blocks", "skipped_blocks", "dropped_blocks", "loaded_blocks", "write_batches"), 0
        )
        self._thread = threading.Thread(target=self._write_loop, name="rayapp-kvtier-writer", daemon=True)
        self._thread.start()

    # --- TierPort -------------------------------------------------------------------------------------------

    def write(self, stored: BlockStored, cache_salt: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """Queue blocks for the tier (`key`, `value`: [L, n, bs, Hkv, D]); drops them past `MAX_PENDING_BYTES`."""
        nbytes = key.nbytes + value.nbytes
        with self._lock:
            if self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.counters["dropped_blocks"] += len(stored.block_hashes)
                return
            self._pending_bytes += nbytes
        self._queue.put(_Run(stored, cache_salt, key, value))

    def fetch(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], cache_salt: str, start_block: int
    ) -> list[KVBlock]:
        """The verified blocks continuing `block_hashes[:start_block]`, or [] when fewer than `min_load_tokens`
        tokens' worth are in the tier. One catalog round trip, then one `get_many` per store."""
        match = self.catalog.longest_chain(block_hashes)
        num_new = match.num_present - start_block
        if num_new * self.block_size < self.min_load_tokens or num_new <= 0:
            return []
        tail = ChainMatch(num_new, match.locations[start_block:])
        parent = block_hashes[start_block - 1] if start_block else None
        tokens = token_ids[start_block * self.block_size : match.num_present * self.block_size]
        blocks = load_chain(tail, tokens, self.block_size, (self.model_id, cache_salt), parent)
        with self._lock:
            self.counters["loaded_blocks"] += len(blocks)
        return blocks

    def stats(self) -> dict[str, int]:
        """This client's counters, named as `METRICS` declares them."""
        with self._lock:
            return {f"tier_{name}": n for name, n in self.counters.items()}

    def metrics(self) -> tuple[Metric, ...]:
        return METRICS

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """What the tier gained and lost since the last call, in order, `tier="cluster"`, for the prefix router:
        runs of blocks this client wrote, and blocks the node's store removed (whoever caused it)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    # --- lifecycle ------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued block was written (or refused)."""
        self._queue.join()

    def close(self) -> None:
        """Finish queued writes, stop the writer thread, close the catalog's connections."""
        self._queue.put(None)
        self._thread.join()
        self.catalog.close()

    # --- writer thread --------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._take_batch()
            try:
                if batch:
                    self._write_batch(batch)
            except RayActorError as error:  # the node's store restarts (Ray brings it back) or went with its node
                dropped = sum(len(run.stored.block_hashes) for run in batch)
                with self._lock:
                    self.counters["dropped_blocks"] += dropped
                logger.warning("cluster KV tier: the node's store did not take %d blocks (%s)", dropped, error)
            except Exception:  # the tier is a cache: a failed write must not stop later ones
                logger.exception("cluster KV tier: writing blocks failed")
            finally:
                with self._lock:
                    self._pending_bytes -= sum(run.nbytes for run in batch)
                for _ in range(len(batch) + stopping):
                    self._queue.task_done()

    def _take_batch(self) -> tuple[list[_Run], bool]:
        """The next runs to write: the first queued and those queued within `coalesce_s` of it, up to
        `max_batch_bytes`; and whether `close` asked the writer to stop after them."""
        run = self._queue.get()
        batch: list[_Run] = []
        nbytes = 0
        deadline = time.monotonic() + self.coalesce_s
        while run is not None:
            batch.append(run)
            nbytes += run.nbytes
            wait = deadline - time.monotonic()
            if nbytes >= self.max_batch_bytes or wait <= 0:
                return batch, False
            try:
                run = self._queue.get(timeout=wait)
            except queue.Empty:
                return batch, False
        return batch, True

    def _write_batch(self, runs: list[_Run]) -> None:
        bs = self.block_size
        held = self.catalog.locate([h for run in runs for h in run.stored.block_hashes])
        blocks: list[np.ndarray] = []
        starts = []  # per run: its first block to write, and where its blocks begin in `blocks`
        for run in runs:
            hashes, stored = run.stored.block_hashes, run.stored
            # Blocks of a run chain, so the ones the tier has are (nearly always) a leading part of it.
            first = 0
            with self._lock:
                while first < len(hashes) and (hashes[first] in held or hashes[first] in self._written):
                    first += 1
                self.counters["skipped_blocks"] += first
            starts.append((first, len(blocks)))
            for i in range(first, len(hashes)):
                parent = hashes[i - 1] if i else stored.parent_block_hash
                block = KVBlock(
                    hashes[i], parent, tuple(stored.token_ids[i * bs : (i + 1) * bs]), self.model_id,
                    run.key[:, i], run.value[:, i], run.cache_salt,
                )  # fmt: skip
                blocks.append(np.frombuffer(encode_block(block), np.uint8))
        if not blocks:
            return
        result = ray.get(self.store.put_many.remote(blocks))
        with self._lock:
            self.counters["write_batches"] += 1
            if result.removed:
                # Ahead of this batch's BlockStored: those blocks left the tier before this batch was stored.
                self._events.append(BlockRemoved(result.removed, Tier.CLUSTER))
                for h in result.removed:  # gone from the tier: write it again when the engine caches it again
                    self._written.pop(h, None)
            for run, (first, offset) in zip(runs, starts):
                end = offset + len(run.stored.block_hashes) - first
                self._note_written(run.stored, first, result.kept[offset:end])

    def _note_written(self, stored: BlockStored, first: int, kept: Sequence[bool]) -> None:
        """Count and remember the blocks of `stored` from `first` on that the store kept, and announce the
        leading ones as a cluster-tier `BlockStored` (lock held)."""
        hashes, bs = stored.block_hashes, self.block_size
        written = [h for h, ok in zip(hashes[first:], kept) if ok]
        n = len(written) if all(kept[: len(written)]) else kept.index(False)
        self.counters["written_blocks"] += len(written)
        for h in written:
            self._written[h] = None
            self._written.move_to_end(h)
        while len(self._written) > _REMEMBERED_WRITES:
            self._written.popitem(last=False)
        if n:
            parent = hashes[first - 1] if first else stored.parent_block_hash
            tokens = stored.token_ids[first * bs : (first + n) * bs]
            self._events.append(BlockStored(tuple(hashes[first : first + n]), parent, tokens, bs, Tier.CLUSTER))


@dataclass(frozen=True)
class _Run:
    """Blocks queued for the tier: a run of `BlockStored` and its pages' K and V ([L, n, bs, Hkv, D])."""

    stored: BlockStored
    cache_salt: str
    key: torch.Tensor
    value: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes


def attach_tier(engine: LLMEngine, node_id: str | None = None) -> KVTierClient:
    """Connect `engine` to the cluster tier its `config.kvtier` names, writing to node `node_id`'s store (Ray must
    be initialized)."""
    spec = engine.spec
    # The catalog's representation column holds one vector per KV head (sparse retrieval's mean keys).
    tier = KVTierClient(
        engine.config.kvtier,
        engine.model_id,
        engine.block_manager.block_size,
        spec.num_kv_heads * spec.head_dim,
        node_id=node_id,
    )
    connect(engine, tier)
    return tier
