"""Moving whole KV pages between the engine's pools and a cluster KV tier, without the engine knowing Ray.

The tier itself (`rayapp.kvtier.client.KVTierClient`) is handed to the engine as a `TierPort`:
- write-through: when the BlockManager caches full blocks, `KVTransfer` copies their pages (all
  layers) out of the device pool on the engine thread, between steps, in one gather per run of
  blocks, and gives the copy to `TierPort.write`, which only queues it: encoding, the catalog and
  the object store happen on the tier's own thread, never on the decode path;
- load on a local miss: before a request is queued, `plan` finds how many leading blocks the
  local cache holds, `TierPort.fetch` (any thread; blocking) returns the verified tier blocks that
  continue that prefix, and `install` writes them into free pages registered as cached blocks, so
  the scheduler's normal prefix match then hits them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from rayapp.blocks import BlockHash, BlockRemoved, BlockStored
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.model_runner import ModelRunner
from rayapp.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class TierBlock(Protocol):
    """One verified block from the tier (`rayapp.kvtier.codec.KVBlock` is one)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    # key, value: [num_layers, block_size, num_kv_heads, head_dim]
    key: torch.Tensor
    value: torch.Tensor


class TierPort(Protocol):
    """What the engine needs from a cluster KV tier."""

    # Load only when the tier holds at least this many prompt tokens beyond the local prefix.
    min_load_tokens: int

    def write(self, stored: BlockStored, cache_salt: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """Queue the blocks of `stored` for the tier; `key`, `value`: [num_layers, n, block_size, Hkv, D] on
        the CPU, owned by the callee. Must return at once."""
        ...

    def fetch(
        self, block_hashes: Seq[BlockHash], token_ids: Seq[int], cache_salt: str, start_block: int
    ) -> list[TierBlock]:
        """The verified tier blocks continuing `block_hashes[:start_block]` (block `start_block` first), or []
        when the tier holds fewer than `min_load_tokens` tokens past `start_block`. Blocking."""
        ...

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The tier's changes since the last call, as `BlockStored` / `BlockRemoved` with `tier="cluster"`: blocks
        this engine wrote, and blocks that left the tier (for the prefix router)."""
        ...


@dataclass(frozen=True)
class TierPlan:
    """A request's leading blocks the local cache holds (`local_blocks`) and how many could be served from
    a cache at all (`usable_blocks`: the last prompt token is always computed)."""

    local_blocks: int
    usable_blocks: int

    @property
    def worth_asking(self) -> bool:
        return self.usable_blocks > self.local_blocks


class KVTransfer:
    """Copies pages between one engine's KV pool and its `TierPort`. Engine thread only, except `fetch`."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, tier: TierPort) -> None:
        if not block_manager.enable_prefix_caching:
            raise ValueError("the cluster KV tier needs enable_prefix_caching=True: tier blocks are cached pages")
        self.runner = runner
        self.block_manager = block_manager
        self.tier = tier
        self.block_size = block_manager.block_size
        block_manager.on_stored = self._write_through

    def plan(self, seq: Sequence) -> TierPlan:
        """How much of `seq`'s prompt the local prefix cache serves now (fills `seq.block_hashes`)."""
        local = self.block_manager.match_prefix(seq).num_tokens // self.block_size
        return TierPlan(local, (seq.num_tokens - 1) // self.block_size)

    def fetch(self, seq: Sequence, plan: TierPlan) -> list[TierBlock]:
        """Tier blocks continuing the local prefix, when that beats recompute. Any thread; blocking."""
        if not plan.worth_asking:
            return []
        hashes = seq.block_hashes[: plan.usable_blocks]
        try:
            return self.tier.fetch(hashes, seq.token_ids, seq.cache_salt, plan.local_blocks)
        except Exception:  # the tier is a cache: whatever went wrong, the prompt is computed instead
            logger.exception("cluster KV tier: fetching blocks for sequence %s failed", seq.seq_id)
            return []

    def install(self, seq: Sequence, plan: TierPlan, blocks: list[TierBlock]) -> tuple[int, int]:
        """Write `blocks` (block `plan.local_blocks` of `seq` onwards) into free pages as cached blocks.

        Returns the prompt token range `[start, end)` they cover. Stops at a block whose shape or dtype
        differ from this engine's pages (another dtype's K/V would change the output) or that is no
        longer the one `seq` needs; installs nothing when the local cache changed since `plan`. The middle
        of a prompt that sparse retrieval offloads goes straight to the host pool (`SparseKV.host_range`):
        only its init and window pages take device pages.
        """
        bs, start = self.block_size, plan.local_blocks
        local = self.block_manager.match_prefix(seq)
        if not blocks or local.num_tokens != start * bs:
            return (0, 0)
        k_pool = self.runner.k_cache
        page_shape = (k_pool.shape[0], *k_pool.shape[2:])
        usable: list[TierBlock] = []
        for i, block in enumerate(blocks, start=start):
            fits = tuple(block.key.shape) == page_shape and block.key.dtype == k_pool.dtype
            if not fits or i >= len(seq.block_hashes) or block.block_hash != seq.block_hashes[i]:
                break
            usable.append(block)
        parent = seq.block_hashes[start - 1] if start else None
        sparse = self.runner.sparse
        host = range(0) if sparse is None else sparse.resume.host_range(seq, start, len(usable))
        head = self._adopt(usable[: host.start - start] if host else usable, parent, local.page_ids)
        if not host or len(head) < host.start - start:
            return (start * bs, (start + len(head)) * bs)
        middle = usable[host.start - start : host.stop - start]
        if not sparse.resume.resume_to_host(seq, host, middle):
            return (start * bs, (start + len(head)) * bs)
        tail = self._adopt(usable[host.stop - start :], middle[-1].block_hash, (*local.page_ids, *head))
        return (start * bs, (host.stop + len(tail)) * bs)

    def _adopt(self, blocks: list[TierBlock], parent: BlockHash | None, keep: tuple[int, ...]) -> tuple[int, ...]:
        """Cached pages for the chain `blocks` (after `parent`), their K/V written in; as many as fit."""
        if not blocks:
            return ()
        page_ids = self.block_manager.adopt_cached_blocks(
            [b.block_hash for b in blocks], parent, [b.token_ids for b in blocks], keep=keep
        )
        if page_ids:
            n, k_pool = len(page_ids), self.runner.k_cache
            pages = torch.tensor(page_ids, device=k_pool.device)
            # [L, n, bs, Hkv, D] scattered into the pool's page dimension, all layers at once.
            key = torch.stack([b.key for b in blocks[:n]], dim=1).to(k_pool.device)
            value = torch.stack([b.value for b in blocks[:n]], dim=1).to(k_pool.device)
            k_pool.index_copy_(1, pages, key)
            self.runner.v_cache.index_copy_(1, pages, value)
        return tuple(page_ids)

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """Blocks written to or gone from the tier since the last call (for the prefix router)."""
        return self.tier.take_events()

    def _write_through(self, stored: BlockStored, cache_salt: str) -> None:
        page_ids = [self.block_manager.cached_page(h) for h in stored.block_hashes]
        pages = torch.tensor(page_ids, device=self.runner.k_cache.device)
        # One gather per run of blocks: [L, n, bs, Hkv, D], a copy the tier owns (the pages get reused).
        key = self.runner.k_cache.index_select(1, pages).to("cpu")
        value = self.runner.v_cache.index_select(1, pages).to("cpu")
        self.tier.write(stored, cache_salt, key, value)
