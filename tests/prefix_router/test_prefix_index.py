"""PrefixIndex against a naive model: random stores, removals, replica deaths and matches agree."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from rayapp.blocks import AllCleared, BlockRemoved, BlockStored, hash_blocks
from rayapp.prefix_router.index import Overlap, PrefixIndex

BS = 2
KEYS = ("model", "")


def chain(tokens: list[int]) -> list:
    return hash_blocks(tokens, BS, KEYS)


def stored(tokens: list[int], start: int = 0, tier: str = "device") -> BlockStored:
    """The event of a replica caching blocks `start..` of `tokens` (their parent cached before)."""
    hashes = chain(tokens)
    parent = hashes[start - 1] if start else None
    return BlockStored(tuple(hashes[start:]), parent, tuple(tokens[start * BS :]), BS, tier)


def test_each_replica_gets_its_own_longest_prefix_and_tiers():
    index = PrefixIndex()
    conversation = [1, 2, 3, 4, 5, 6, 7, 8]
    index.apply("a", [stored(conversation)])
    index.apply("b", [stored(conversation[:4])])
    index.apply("b", [stored(conversation[:6], start=2, tier="host")])
    assert index.match(chain(conversation)) == {
        "a": Overlap(4, ("device",) * 4),
        "b": Overlap(3, ("device", "device", "host")),
    }


def test_a_hole_in_the_chain_ends_the_match():
    index = PrefixIndex()
    tokens = [1, 2, 3, 4, 5, 6]
    index.apply("a", [stored(tokens), BlockRemoved((chain(tokens)[1],))])
    assert index.match(chain(tokens)) == {"a": Overlap(1, ("device",))}


def test_dead_replica_disappears_and_its_blocks_are_freed():
    index = PrefixIndex()
    index.apply("a", [stored([1, 2, 3, 4])])
    index.apply("b", [stored([1, 2, 9, 9])])
    index.remove_replica("a")
    assert index.replicas == {"b"} and len(index) == 2
    assert index.match(chain([1, 2, 3, 4])) == {"b": Overlap(1, ("device",))}
    index.apply("b", [AllCleared()])
    assert len(index) == 0 and index.match(chain([1, 2])) == {}


def test_child_stored_before_its_parent_links_up_when_the_parent_arrives():
    index = PrefixIndex()
    tokens = [1, 2, 3, 4]
    index.apply("a", [stored(tokens, start=1)])
    assert index.match(chain(tokens)) == {}
    index.apply("a", [stored(tokens[:2])])
    assert index.match(chain(tokens)) == {"a": Overlap(2, ("device", "device"))}


def test_memory_is_bounded_by_dropping_least_recently_used_leaves():
    index = PrefixIndex(max_blocks=4)
    old, new = [1, 1, 2, 2, 3, 3], [7, 7, 8, 8]
    index.apply("a", [stored(old)])
    index.apply("a", [stored(new)])
    assert len(index) == 4
    # The newest chain survives whole; the old one keeps its head (leaves go first).
    assert index.match(chain(new)) == {"a": Overlap(2, ("device", "device"))}
    assert index.match(chain(old))["a"].blocks == 2


def test_snapshot_restores_the_same_answers():
    index = PrefixIndex()
    index.apply("a", [stored([1, 2, 3, 4, 5, 6])])
    index.apply("b", [stored([1, 2, 3, 4], tier="host")])
    again = PrefixIndex.restore(index.snapshot())
    for query in ([1, 2, 3, 4, 5, 6], [1, 2], [3, 4]):
        assert again.match(chain(query)) == index.match(chain(query))


def test_max_blocks_must_be_positive():
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(max_blocks=0)


REPLICAS = ("r0", "r1", "r2")
token_lists = st.lists(st.integers(1, 3), min_size=BS, max_size=5 * BS)


class IndexMachine(RuleBasedStateMachine):
    """Replicas store chains (tail blocks after cached heads), evict blocks and die; every
    match equals a naive per-replica set of held hashes walked from the first block."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.held: dict[str, dict] = {r: {} for r in REPLICAS}

    @rule(
        replica=st.sampled_from(REPLICAS),
        tokens=token_lists,
        start=st.integers(0, 4),
        tier=st.sampled_from(("device", "host")),
    )
    def store(self, replica, tokens, start, tier):
        hashes = chain(tokens)
        start = min(start, len(hashes) - 1)
        self.index.apply(replica, [stored(tokens, start, tier)])
        self.held[replica].update({h: tier for h in hashes[start:]})

    @rule(replica=st.sampled_from(REPLICAS), tokens=token_lists, which=st.integers(0, 4))
    def evict(self, replica, tokens, which):
        hashes = chain(tokens)
        h = hashes[min(which, len(hashes) - 1)]
        if h in self.held[replica]:
            self.index.apply(replica, [BlockRemoved((h,), self.held[replica].pop(h))])

    @rule(replica=st.sampled_from(REPLICAS))
    def die(self, replica):
        self.index.remove_replica(replica)
        self.held[replica] = {}

    @rule(tokens=token_lists)
    def match(self, tokens):
        hashes = chain(tokens)
        expected = {}
        for replica, held in self.held.items():
            n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if n:
                expected[replica] = Overlap(n, tuple(held[h] for h in hashes[:n]))
        assert self.index.match(hashes) == expected

    @invariant()
    def every_held_block_has_a_node(self):
        held = set().union(*self.held.values())
        assert self.index.replicas == {r for r, h in self.held.items() if h}
        assert held <= set(self.index._nodes)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
