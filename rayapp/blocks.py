"""Block identity and the events a replica emits when its prefix cache changes.

Engine, ingress, router and cluster tier all name a block by `hash_block`'s chained hash: the same
block has the same hash on every replica, node and tier. The prefix router builds its index only
from these events (never guessed from text), so each one states exactly what changed. This module
sits below all of them (it imports nothing of rayapp's), so none imports another for it.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections import abc
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", int)


class Tier(str, enum.Enum):
    """Where an announced block is held."""

    # A replica's own page pool.
    DEVICE = "device"
    # The cluster KV tier (`rayapp.kvtier`): loadable by every replica, not only the one announcing it.
    CLUSTER = "cluster"


# Versioned, so a change of packing can never match hashes made by an older replica.
_HASH_PERSON = b"rayapp-kv-v1"


def hash_block(parent: BlockHash | None, token_ids: abc.Sequence[int], extra_keys: tuple[str, ...]) -> BlockHash:
    """Stable 64-bit hash of one full block, chained on its parent's hash (None for block 0).

    Identical in every process and on every machine (unlike `hash`): blake2b over a fixed
    little-endian packing, with every variable-length field length-prefixed so that no two
    different inputs pack to the same bytes. `extra_keys` holds `(model_id, cache_salt)`.
    """
    h = hashlib.blake2b(digest_size=8, person=_HASH_PERSON)
    h.update(struct.pack("<BQ", parent is not None, 0 if parent is None else parent))
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        data = key.encode("utf-8")
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return BlockHash(int.from_bytes(h.digest(), "little"))


def hash_blocks(
    token_ids: abc.Sequence[int], block_size: int, extra_keys: tuple[str, ...], parent: BlockHash | None = None
) -> list[BlockHash]:
    """Hash chain of every full block of `token_ids` (a trailing partial block is not hashed).

    The ingress and router use this to compute the same hashes the replicas' BlockManagers do.
    """
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became cached (revivable) in `tier`.

    `block_hashes` chain: the first block's parent is `parent_block_hash` (None for a first
    block), each next block's parent is the hash before it. `token_ids` holds the tokens of all
    the blocks, concatenated (`len(token_ids) == len(block_hashes) * block_size`), or nothing in the events a
    replica sends the PrefixIndex, which keys blocks by hash alone (`publisher.on_the_wire`).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks are no longer cached in `tier` (their pages were reused)."""

    block_hashes: tuple[BlockHash, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class AllCleared:
    """Every block of the emitting replica's cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllCleared
