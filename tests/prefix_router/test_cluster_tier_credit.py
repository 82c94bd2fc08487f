"""Blocks in the cluster KV tier are credited to every replica as loadable, and priced as such by the policy."""

from __future__ import annotations

import random

from rayapp.blocks import AllCleared, BlockRemoved, BlockStored, Tier, hash_blocks
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import PrefixIndexService
from rayapp.prefix_router.policy import FALLBACK, OVERLAP, Holding, rank

BS = 4
TOKENS = list(range(32))
HASHES = hash_blocks(TOKENS, BS, ("m", ""))  # 8 blocks


def stored(start: int, end: int, tier: str = "device") -> BlockStored:
    parent = HASHES[start - 1] if start else None
    return BlockStored(tuple(HASHES[start:end]), parent, tuple(TOKENS[start * BS : end * BS]), BS, tier)


def test_tier_blocks_count_for_every_replica_as_loadable_past_their_own():
    service = PrefixIndexService(max_blocks=100, replica_timeout_s=60)
    service.publish("a", 0, [AllCleared(), stored(0, 6), stored(0, 6, Tier.CLUSTER)])
    service.publish("b", 0, [AllCleared(), stored(0, 2)])
    holdings = service.match(HASHES, ["a", "b", "c"])
    assert holdings == {"a": Holding(6, 0), "b": Holding(6, 4), "c": Holding(6, 6)}
    # A scaled-down replica's device blocks go; what it wrote to the tier stays loadable by the others.
    service.remove_replica("a")
    assert service.match(HASHES, ["b", "c"]) == {"b": Holding(6, 4), "c": Holding(6, 6)}
    assert service.replicas() == ["b"]


def test_device_blocks_beyond_the_tier_keep_their_own_count():
    service = PrefixIndexService(max_blocks=100, replica_timeout_s=60)
    service.publish("a", 0, [AllCleared(), stored(0, 8), stored(0, 3, Tier.CLUSTER)])
    assert service.match(HASHES, ["a", "b"]) == {"a": Holding(8, 0), "b": Holding(3, 3)}


def test_blocks_gone_from_the_tier_stop_counting_for_every_replica_but_their_device_holder():
    service = PrefixIndexService(max_blocks=100, replica_timeout_s=60)
    service.publish("a", 0, [AllCleared(), stored(0, 6), stored(0, 6, Tier.CLUSTER)])
    # b's write made its node's store evict the tail of a's run: b reports it, for the tier as a whole.
    service.publish("b", 0, [AllCleared(), BlockRemoved(tuple(HASHES[4:6]), Tier.CLUSTER)])
    assert service.match(HASHES, ["a", "b", "c"]) == {"a": Holding(6, 0), "b": Holding(4, 4), "c": Holding(4, 4)}
    # A replica's own device eviction leaves the tier's copy alone, and the other way round.
    service.publish("a", 1, [BlockRemoved(tuple(HASHES[2:6]))])
    assert service.match(HASHES, ["a", "c"]) == {"a": Holding(4, 2), "c": Holding(4, 4)}
    service.publish("b", 1, [BlockRemoved(tuple(HASHES[:4]), Tier.CLUSTER)])
    assert service.match(HASHES, ["a", "c"]) == {"a": Holding(2, 0)}


def test_policy_prefers_the_holder_then_prices_tier_blocks_below_recompute():
    config = RouterConfig(loadable_weight=0.25, queue_weight_tokens=0)
    service = PrefixIndexService(max_blocks=100, replica_timeout_s=60)
    service.publish("a", 0, [AllCleared(), stored(0, 8, Tier.CLUSTER)])
    service.publish("b", 0, [AllCleared(), stored(0, 8)])
    holdings = service.match(HASHES, ["a", "c", "b"])
    decision = rank(["a", "c", "b"], len(TOKENS), BS, holdings, {}, config, random.Random(0))
    assert decision.reason == OVERLAP and decision.ranked[0] == "b"
    # Without the tier credit nobody else would count; with it, a cold replica still routes by overlap
    # (not power-of-two) and is predicted to serve the loadable blocks from cache.
    cold = rank(["a", "c"], len(TOKENS), BS, holdings, {}, config, random.Random(0))
    assert cold.reason == OVERLAP and cold.predicted_cached_tokens == (len(TOKENS) - 1) // BS * BS
    assert rank(["c"], len(TOKENS), BS, {}, {}, config, random.Random(0)).reason == FALLBACK
