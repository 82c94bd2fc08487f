"""PrefixIndex against a naive model: random stores, removals, replica deaths, matches and LRU evictions agree."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, hash_blocks
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


def test_a_hot_shared_prefix_outlives_colder_conversations_once_they_are_evicted():
    index = PrefixIndex(max_blocks=6)
    system = [0, 0, 1, 1]  # 2 blocks every conversation starts with
    for c in (5, 6):
        index.apply("a", [stored(system + [c, c])])
    index.apply("b", [stored([9, 9, 8, 8])])
    index.match(chain(system))  # a new request reads the shared prefix: it is now the most recent
    # Two more blocks: the two oldest leaves (the first conversation, then the second) go; the
    # shared prefix, a leaf now, stays: its own use is newer than b's chain.
    index.apply("b", [stored([9, 9, 8, 8, 7, 7, 6, 6], start=2)])
    assert len(index) == 6
    assert index.match(chain(system + [5, 5])) == {"a": Overlap(2, ("device", "device"))}
    assert index.match(chain([9, 9, 8, 8, 7, 7, 6, 6]))["b"].blocks == 4


def _fill(index: PrefixIndex, conversations: int, turns: int, first: int = 0) -> int:
    """Conversations of `turns` one-block turns, each turn stored as a tail after its history (so
    the history is older than the tail: the inner nodes an eviction scan would have to skip)."""
    blocks = 0
    for turn in range(turns):
        for c in range(first, first + conversations):
            tokens = [c, c, *range(2 * turn)] if turn else [c, c]
            index.apply(f"r{c % 64}", [stored(tokens[: 2 * turn + 2], start=turn)])
            blocks += 1
    return blocks


@pytest.mark.parametrize("size", [2_000, 20_000])
def test_storing_into_a_full_index_costs_what_the_batch_costs_whatever_its_size(size):
    index = PrefixIndex(max_blocks=size)
    stored_blocks = _fill(index, size // 8, 8)
    assert len(index) == size and index.eviction_visits == 0
    stored_blocks += _fill(index, size // 4, 8, first=size)  # twice the index's size again, all evicting
    # Each eviction looks at the evicted leaf, plus at inner nodes it parks: each once per use, so at
    # most one per stored block, amortized. Counted in nodes, the same for 2K and 20K blocks.
    assert len(index) == size and index.eviction_visits <= 2 * stored_blocks


def test_memory_per_block_stays_under_200_bytes():
    import tracemalloc

    size = 50_000
    tracemalloc.start()
    try:
        index = PrefixIndex(max_blocks=size)
        for start in range(0, size, 25):  # each event made and dropped as the actor unpickles one: its keys stay
            hashes = tuple(BlockHash((7919 * i) ^ (1 << 63)) for i in range(start, start + 25))  # 64-bit
            index.apply(f"r{start % 64}", [BlockStored(hashes, None, (), 0)])
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == size and used / size < 200


REPLICAS = ("r0", "r1", "r2")
token_lists = st.lists(st.integers(1, 3), min_size=BS, max_size=5 * BS)


class NaiveIndex:
    """The index's rules, brute force: nodes in a dict, children found by scanning, the least recently
    used leaf found by a full scan."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks, self.clock = max_blocks, 0
        self.parent: dict = {}
        self.holders: dict[object, dict[str, str]] = {}
        self.used: dict = {}

    def use(self, h) -> None:
        self.clock += 1
        self.used[h] = self.clock

    def node(self, h, parent=None) -> None:
        if h not in self.parent:
            self.parent[h], self.holders[h] = None, {}
            self.use(h)
        if self.parent[h] is None and parent is not None:
            self.parent[h] = parent

    def store(self, replica: str, event: BlockStored) -> None:
        parent = event.parent_block_hash
        if parent is not None:
            self.node(parent)
        for h in event.block_hashes:
            known = h in self.parent
            self.node(h, parent)
            if known:
                self.use(h)
            self.holders[h][replica] = event.tier
            parent = h

    def children(self, h) -> list:
        return [c for c, p in self.parent.items() if p == h]

    def delete(self, h) -> None:
        del self.parent[h], self.holders[h], self.used[h]

    def prune(self, h) -> None:
        while h is not None and h in self.parent and not self.holders[h] and not self.children(h):
            parent = self.parent[h]
            self.delete(h)
            h = parent

    def drop(self, replica: str, h, tier: str) -> None:
        if h in self.holders and self.holders[h].get(replica) == tier:
            del self.holders[h][replica]
            self.prune(h)

    def die(self, replica: str) -> None:
        held = [h for h, holders in self.holders.items() if holders.pop(replica, None) is not None]
        for h in held:
            self.prune(h)

    def touch_match(self, hashes: list) -> None:
        """The nodes a match walks (and so uses): linked from the first, while someone holds them all."""
        expected, alive = None, None
        for h in hashes:
            if h not in self.parent or self.parent[h] != expected:
                return
            self.use(h)
            alive = set(self.holders[h]) if alive is None else alive & set(self.holders[h])
            if not alive:
                return
            expected = h

    def bound(self) -> None:
        while len(self.parent) > self.max_blocks:
            self.delete(min((h for h in self.parent if not self.children(h)), key=self.used.__getitem__))

    def rows(self) -> set:
        return {(h, p, tuple(sorted(self.holders[h].items()))) for h, p in self.parent.items()}


class IndexMachine(RuleBasedStateMachine):
    """Replicas store chains (tail blocks after cached heads), evict blocks, die and are matched,
    into an index small enough to fill: every match, and the set of nodes the index keeps (so the
    order of its LRU evictions), equal a naive model's."""

    @initialize(max_blocks=st.sampled_from((3, 5, 8, 1_000)))
    def start(self, max_blocks):
        self.index, self.model = PrefixIndex(max_blocks), NaiveIndex(max_blocks)

    @rule(
        replica=st.sampled_from(REPLICAS),
        tokens=token_lists,
        start=st.integers(0, 4),
        tier=st.sampled_from(("device", "host")),
    )
    def store(self, replica, tokens, start, tier):
        start = min(start, len(chain(tokens)) - 1)
        self.index.apply(replica, [stored(tokens, start, tier)])
        self.model.store(replica, stored(tokens, start, tier))
        self.model.bound()

    @rule(replica=st.sampled_from(REPLICAS), tokens=token_lists, which=st.integers(0, 4))
    def evict(self, replica, tokens, which):
        hashes = chain(tokens)
        h = hashes[min(which, len(hashes) - 1)]
        tier = self.model.holders.get(h, {}).get(replica)
        if tier is not None:
            self.index.apply(replica, [BlockRemoved((h,), tier)])
            self.model.drop(replica, h, tier)
            self.model.bound()

    @rule(replica=st.sampled_from(REPLICAS))
    def die(self, replica):
        self.index.remove_replica(replica)
        self.model.die(replica)

    @rule(tokens=token_lists)
    def match(self, tokens):
        hashes = chain(tokens)
        expected = {}
        for replica in REPLICAS:
            held = {h: holders[replica] for h, holders in self.model.holders.items() if replica in holders}
            n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if n:
                expected[replica] = Overlap(n, tuple(held[h] for h in hashes[:n]))
        assert self.index.match(hashes) == expected
        self.model.touch_match(hashes)

    @invariant()
    def the_index_keeps_the_models_nodes(self):
        rows = {(h, p, tuple(sorted(holders.items()))) for h, p, holders in self.index.snapshot()}
        assert rows == self.model.rows()
        assert len(self.index) <= self.index.max_blocks
        assert self.index.replicas == {r for holders in self.model.holders.values() for r in holders}
        for replica in REPLICAS:
            held = sorted(h for h, holders in self.model.holders.items() if replica in holders)
            assert sorted(self.index.blocks_of(replica)) == held


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
