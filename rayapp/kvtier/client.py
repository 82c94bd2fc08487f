"""`KVTierClient`: one engine's side of the cluster tier (the `TierPort` of `rayapp.engine.tier_connector`).

Writes go through a queue to one background thread, which skips blocks the catalog already has,
encodes the rest and hands them to the node's `KVTierStore` in one `put_many` per run: the engine
thread only copies pages and enqueues. What the tier gained and lost through those puts is kept as
events for the prefix router (`take_events`): the blocks written, and the blocks the store reports
gone (evicted for room, or rows of a dead node it pruned). Reads (`fetch`) ask the catalog for the
longest stored continuation of a prompt's hash chain and load it through `loader.load_chain`, which
verifies every block (hash, parent, token ids, tenant) before the engine sees it.

The tier never fails a request: with the database unreachable the catalog disables itself with one
warning, `fetch` returns nothing (the engine recomputes) and writes are dropped; a store or object
that is gone ends a load early, the same way.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import ray
import torch

from rayapp.blocks import BlockHash, BlockRemoved, BlockStored, Tier
from rayapp.config import KVTierConfig
from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.codec import KVBlock, encode_block
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
        "tier_dropped_blocks": "Blocks not written because the writer was too far behind (the tier is a cache)",
        "tier_loaded_blocks": "Blocks this engine loaded from the cluster KV tier",
    }
)
# Copied pages waiting for the writer thread, at most: past it new blocks are not written (the tier is a
# cache; an engine must not grow without bound because the object store or the database is slow).
MAX_PENDING_BYTES = 512 << 20
# Hashes this client wrote recently, so a block cached again locally (after eviction) is not re-sent.
_REMEMBERED_WRITES = 1 << 16


class KVTierClient:
    """Connects one engine to the cluster tier: the catalog at `config.dsn` (or the embedded database,
    started once per cluster when `dsn` is unset) and this node's store actor. Needs Ray initialized."""

    def __init__(self, config: KVTierConfig, model_id: str, block_size: int, representation_dim: int) -> None:
        if not ray.is_initialized():
            raise RuntimeError("the cluster KV tier needs Ray: call ray.init() first (the offline LLM does)")
        self.config = config
        self.model_id = model_id
        self.block_size = block_size
        self.min_load_tokens = config.min_load_tokens
        self.dsn = config.dsn or start_embedded_database(config.data_dir)
        self.catalog = Catalog(self.dsn, representation_dim)
        self.store = get_or_create_store(self.dsn, representation_dim, config.capacity_bytes)
        self._queue: queue.Queue[tuple[BlockStored, str, torch.Tensor, torch.Tensor] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._events: list[BlockStored | BlockRemoved] = []
        self._written: OrderedDict[BlockHash, None] = OrderedDict()
        self.counters = {"written_blocks": 0, "skipped_blocks": 0, "dropped_blocks": 0, "loaded_blocks": 0}
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
        self._queue.put((stored, cache_salt, key, value))

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
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write_run(*item)
            except Exception:  # the tier is a cache: a failed write must not stop later ones
                logger.exception("cluster KV tier: writing blocks failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending_bytes -= item[2].nbytes + item[3].nbytes
                self._queue.task_done()

    def _write_run(self, stored: BlockStored, cache_salt: str, key: torch.Tensor, value: torch.Tensor) -> None:
        hashes = list(stored.block_hashes)
        bs = self.block_size
        # Blocks of a run chain, so the ones the catalog has are (nearly always) a leading part of it.
        first = self.catalog.longest_chain(hashes).num_present
        with self._lock:
            while first < len(hashes) and hashes[first] in self._written:
                first += 1
        self.counters["skipped_blocks"] += first
        if first == len(hashes):
            return
        blocks = []
        for i in range(first, len(hashes)):
            parent = hashes[i - 1] if i else stored.parent_block_hash
            block = KVBlock(
                hashes[i], parent, tuple(stored.token_ids[i * bs : (i + 1) * bs]), self.model_id,
                key[:, i], value[:, i], cache_salt,
            )  # fmt: skip
            blocks.append(np.frombuffer(encode_block(block), np.uint8))
        result = ray.get(self.store.put_many.remote(blocks))
        kept = result.kept
        written = [h for h, ok in zip(hashes[first:], kept) if ok]
        n = len(written) if all(kept[: len(written)]) else kept.index(False)
        with self._lock:
            if result.removed:
                # Ahead of this run's BlockStored: those blocks left the tier before this run was stored.
                self._events.append(BlockRemoved(result.removed, Tier.CLUSTER))
                for h in result.removed:  # gone from the tier: write it again when the engine caches it again
                    self._written.pop(h, None)
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


def attach_tier(engine: LLMEngine) -> KVTierClient:
    """Connect `engine` to the cluster tier its `config.kvtier` names (Ray must be initialized)."""
    spec = engine.spec
    # The catalog's representation column holds one vector per KV head (sparse retrieval's mean keys).
    tier = KVTierClient(
        engine.config.kvtier, engine.model_id, engine.block_manager.block_size, spec.num_kv_heads * spec.head_dim
    )
    engine.attach_tier(tier)
    return tier
