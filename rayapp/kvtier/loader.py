"""Fetching a catalogued chain of blocks from the node stores, verified before anyone uses it.

A catalog row says where a block should be; only the block itself says what it is. Every fetched
block is decoded (shape, length and CRC checked by the codec) and then matched against what the
caller expects at that position: its hash, its parent, its token ids, and the hash recomputed
from those tokens with the caller's model id and tenant salt. The first block that is missing,
unreadable or different ends the chain: the blocks before it are returned, never a wrong one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray

from rayapp.blocks import BlockHash, hash_block
from rayapp.kvtier.codec import BlockFormatError, KVBlock, decode_block
from rayapp.kvtier.embedded import NAMESPACE
from rayapp.kvtier.records import ChainMatch

logger = logging.getLogger("rayapp.kvtier")


def verify_block(
    block: KVBlock,
    expected_hash: BlockHash,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, str],
    layer_group: int = 0,
) -> bool:
    """Whether `block` is exactly the block a sequence needs at this position.

    `extra_keys` is `(model_id, cache_salt)`, as the engine hashes with.
    """
    return (
        block.block_hash == expected_hash
        and block.parent_hash == parent
        and block.token_ids == tuple(token_ids)
        and (block.model_id, block.cache_salt) == extra_keys
        and block.layer_group == layer_group
        and hash_block(parent, block.token_ids, extra_keys) == expected_hash
    )


def _store_runs(match: ChainMatch) -> list[tuple[str, list[BlockHash]]]:
    # Consecutive blocks in one store are fetched with one get_many.
    runs: list[tuple[str, list[BlockHash]]] = []
    for loc in match.locations:
        if runs and runs[-1][0] == loc.store_name:
            runs[-1][1].append(loc.block_hash)
        else:
            runs.append((loc.store_name, [loc.block_hash]))
    return runs


def _verified_prefix(
    datas: Sequence[object | None],
    match: ChainMatch,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, str],
    parent: BlockHash | None,
    layer_group: int,
) -> list[KVBlock]:
    blocks: list[KVBlock] = []
    for i, (data, loc) in enumerate(zip(datas, match.locations)):
        if data is None:
            break
        try:
            block = decode_block(data)
        except BlockFormatError as err:
            logger.warning("cluster KV tier block %#018x from %s is damaged: %s", loc.block_hash, loc.store_name, err)
            break
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        if len(tokens) < block_size or not verify_block(block, loc.block_hash, parent, tokens, extra_keys, layer_group):
            break
        blocks.append(block)
        parent = loc.block_hash
    return blocks


def _ask_stores(match: ChainMatch, layer_group: int) -> list[ray.ObjectRef]:
    """Send every store its get_many at once; the list stops at the first store that is gone."""
    calls = []
    for store, hashes in _store_runs(match):
        try:
            calls.append(ray.get_actor(store, namespace=NAMESPACE).get_many.remote(hashes, layer_group))
        except ValueError:
            break  # the store (or its node) is gone: its blocks, and the chain after them, are lost
    return calls


# A store that is gone: dead or restarting (RayActorError), pinned to a node that died (unschedulable),
# on a node that died mid-call, the owner of the bytes gone (ObjectLostError), or no answer in
# LOAD_TIMEOUT_S (a node cut off but not yet declared dead). Each is a miss: the blocks are
# recomputed, never an error for the request.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnschedulableError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.GetTimeoutError,
)
# A healthy 4K-token load answers in ~0.3 s (bench/kvtier.py); Ray takes tens of seconds to declare a
# silent node dead. Past this a request stops waiting and recomputes.
LOAD_TIMEOUT_S = 10.0


def load_chain(
    match: ChainMatch,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, str],
    parent: BlockHash | None = None,
    layer_group: int = 0,
) -> list[KVBlock]:
    """Fetch and verify the blocks `match` locates; the verified leading run, in order.

    `token_ids` are the tokens from the first located block on (`block_size` per block), `parent`
    the hash of the block before it (None at the start of a prompt). All stores are asked at
    once, one `get_many` per run of consecutive blocks in the same store. Blocks on Ray: replicas
    call it from a worker thread (`asyncio.to_thread`), never inside an event loop.
    """
    datas: list[object | None] = []
    for call in _ask_stores(match, layer_group):
        try:
            refs = ray.get(call, timeout=LOAD_TIMEOUT_S)
            present = [r for r in refs if r is not None]
            fetched = iter(ray.get(present, timeout=LOAD_TIMEOUT_S))
        except _LOST:
            break
        datas.extend(next(fetched) if r is not None else None for r in refs)
        if len(present) < len(refs):
            break
    return _verified_prefix(datas, match, token_ids, block_size, extra_keys, parent, layer_group)
