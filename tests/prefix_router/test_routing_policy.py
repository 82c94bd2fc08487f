"""The routing policy: overlap wins on balanced load, load wins on a swamped replica, power-of-two without an index."""

from __future__ import annotations

import random

from rayapp.config import RouterConfig
from rayapp.prefix_router.policy import FALLBACK, LOAD, OVERLAP, Holding, cached_tokens, rank

BS = 16
CONFIG = RouterConfig()
REPLICAS = ["a", "b", "c"]


def decide(holdings, ongoing, prompt_tokens=1000, config=CONFIG, seed=0):
    return rank(REPLICAS, prompt_tokens, BS, holdings, ongoing, config, random.Random(seed))


def test_overlap_wins_when_load_is_balanced():
    decision = decide({"b": Holding(50), "c": Holding(10)}, {"a": 2, "b": 2, "c": 2})
    assert decision.ranked == ["b", "c", "a"]
    assert decision.reason == OVERLAP
    assert decision.predicted_cached_tokens == 50 * BS


def test_overlap_still_wins_over_a_slightly_busier_replica():
    # 800 cached tokens outweigh one more ongoing request (64 tokens of work by default).
    decision = decide({"b": Holding(50)}, {"a": 0, "b": 1, "c": 0})
    assert decision.ranked[0] == "b" and decision.reason == OVERLAP


def test_load_wins_when_the_holder_is_swamped():
    decision = decide({"b": Holding(50)}, {"a": 1, "b": 40, "c": 3})
    assert decision.ranked[0] == "a"
    assert decision.reason == LOAD
    assert decision.predicted_cached_tokens == 0


def test_fallback_is_power_of_two_when_the_index_is_down():
    seen = set()
    for seed in range(50):
        decision = decide(None, {"a": 0, "b": 0, "c": 0}, seed=seed)
        assert decision.reason == FALLBACK and decision.predicted_cached_tokens == 0
        assert len(decision.ranked) == 2 and len(set(decision.ranked)) == 2
        seen.update(decision.ranked)
    assert seen == set(REPLICAS)  # random pairs: every replica gets traffic


def test_fallback_when_no_replica_holds_enough_blocks():
    config = RouterConfig(min_overlap_blocks=4)
    assert decide({"a": Holding(3)}, {}, config=config).reason == FALLBACK
    assert decide({"a": Holding(4)}, {}, config=config).reason == OVERLAP


def test_offloaded_blocks_are_cheaper_than_recompute_but_dearer_than_device_blocks():
    on_host = {"b": Holding(50, offloaded=50), "c": Holding(50)}
    assert decide(on_host, {}).ranked == ["c", "b", "a"]
    assert decide({"b": Holding(50, offloaded=50)}, {}).ranked[0] == "b"


def test_predicted_tokens_never_count_the_last_prompt_token():
    # A prompt of exactly 4 full blocks: the engine recomputes the last token, so only 3 blocks hit.
    assert cached_tokens(4, 4 * BS, BS) == 3 * BS
    assert decide({"a": Holding(4)}, {}, prompt_tokens=4 * BS).predicted_cached_tokens == 3 * BS
    assert cached_tokens(2, 0, BS) == 0
