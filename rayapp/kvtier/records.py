"""The small named types the catalog takes and returns (see `rayapp.kvtier.catalog`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rayapp.engine.kv_events import BlockHash


@dataclass(frozen=True)
class BlockRow:
    """What a store writes for one block it holds. Hashes are rayapp's unsigned 64-bit values."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    model_id: str
    cache_salt: str
    layer_group: int
    node_id: str
    store_name: str
    nbytes: int
    num_tokens: int
    # The block's retrieval representation (per KV head, flattened), or None.
    representation: Sequence[float] | np.ndarray | None = None


@dataclass(frozen=True)
class BlockLocation:
    """Where one catalogued block lives: the store actor `store_name` on node `node_id`."""

    block_hash: BlockHash
    layer_group: int
    node_id: str
    store_name: str
    nbytes: int
    num_tokens: int


@dataclass(frozen=True)
class ChainMatch:
    """The leading `num_present` blocks of a hash chain are in the tier, at `locations` (in order)."""

    num_present: int = 0
    locations: tuple[BlockLocation, ...] = ()


@dataclass(frozen=True)
class ScoredBlock:
    location: BlockLocation
    # query · representation (larger is more relevant).
    score: float


@dataclass(frozen=True)
class TierUsage:
    num_blocks: int = 0
    nbytes: int = 0
