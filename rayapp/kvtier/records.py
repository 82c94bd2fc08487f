"""The small named types the catalog takes and returns (see `rayapp.kvtier.catalog`), and the
mapping of rayapp's unsigned 64-bit block hashes onto the database's signed BIGINT."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rayapp.blocks import BlockHash

_U64 = 1 << 64
_I63 = 1 << 63


def to_db_hash(block_hash: int) -> int:
    """An unsigned 64-bit block hash as the signed BIGINT with the same bits."""
    if not 0 <= block_hash < _U64:
        raise ValueError(f"block hash {block_hash} is not an unsigned 64-bit value")
    return block_hash - _U64 if block_hash >= _I63 else block_hash


def from_db_hash(value: int) -> BlockHash:
    """The inverse of `to_db_hash`."""
    return BlockHash(value + _U64 if value < 0 else value)


class BlockKey(NamedTuple):
    """One catalog row's key (and a store's key for the bytes): the block and its layer group."""

    block_hash: BlockHash
    layer_group: int


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
