"""BlockManager: prefix sharing, lazy eviction, forks and events, as the scheduler drives them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rayapp.engine import kv_events
from rayapp.engine.block_manager import BlockManager, PageCopy, PrefixMatch
from rayapp.engine.kv_events import AllCleared, BlockRemoved, BlockStored, hash_block, hash_blocks
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.sequence import BlockHash, Sequence

BS = 4
MODEL = "smollm2"


def make_seq(tokens, seq_id: str = "s", salt: str = "") -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, seq: Sequence) -> PrefixMatch | None:
    """Admit `seq` as the scheduler does and compute its whole prompt; None when no room."""
    match = bm.match_prefix(seq)
    if not bm.allocate(seq, seq.num_tokens - match.num_tokens, match):
        return None
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return match


def finished(bm: BlockManager, tokens, seq_id: str = "finished") -> tuple[Sequence, list[int]]:
    """A request that was served and finished: its full blocks stay cached. Drains the events."""
    seq = make_seq(tokens, seq_id)
    assert admit(bm, seq) is not None
    pages = list(seq.block_table)
    bm.free(seq)
    bm.take_events()
    return seq, pages


def pool_state(bm: BlockManager) -> tuple:
    return bm.num_free_pages, bm.num_cached_pages, [bm.page_info(p) for p in range(bm.num_pages)]


def removed_hashes(events) -> set[BlockHash]:
    return {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


def test_second_request_with_same_prompt_reuses_pages():
    bm = BlockManager(16, BS, MODEL)
    prompt = list(range(10))  # two full blocks and two tokens
    first = make_seq(prompt, "first")
    assert admit(bm, first) == PrefixMatch()
    first_pages = list(first.block_table)

    second = make_seq(prompt, "second")
    assert admit(bm, second) == PrefixMatch(tuple(first_pages[:2]), 8) and second.num_cached_tokens == 8
    assert second.block_table[:2] == first_pages[:2] and second.block_table[2] != first_pages[2]
    assert [bm.page_info(p).ref_count for p in first_pages] == [2, 2, 1]
    # A prompt of whole blocks still computes its last block, to get the logits of its last token.
    assert bm.match_prefix(make_seq(range(8), "whole-blocks")).num_tokens == 4


def test_hash_collision_never_serves_wrong_tokens(monkeypatch):
    # Every block hashes alike: only the stored token ids and parent can tell blocks apart.
    monkeypatch.setattr(kv_events, "hash_block", lambda parent, token_ids, extra_keys: BlockHash(7))
    bm = BlockManager(16, BS, MODEL)
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "first")
    admit(bm, first)
    assert bm.match_prefix(make_seq([4, 3, 2, 1, 5, 6, 7, 8, 9], "other-start")) == PrefixMatch()
    same_start = bm.match_prefix(make_seq([1, 2, 3, 4, 8, 7, 6, 5, 9], "same-start"))
    assert same_start == PrefixMatch((first.block_table[0],), 4)
    # Block 1 has block 0's tokens and hash but another parent (and position): not a hit.
    repeated = bm.match_prefix(make_seq([1, 2, 3, 4, 1, 2, 3, 4, 9], "repeated"))
    assert repeated == PrefixMatch((first.block_table[0],), 4)


def test_different_salt_never_shares_pages():
    bm = BlockManager(16, BS, MODEL)
    tenant_a = make_seq(range(9), "a", salt="tenant-a")
    admit(bm, tenant_a)
    tenant_b = make_seq(range(9), "b", salt="tenant-b")
    assert admit(bm, tenant_b) == PrefixMatch()
    assert not set(tenant_a.block_table) & set(tenant_b.block_table)
    assert not set(tenant_a.block_hashes) & set(tenant_b.block_hashes)
    assert admit(bm, make_seq(range(9), "a2", salt="tenant-a")).num_tokens == 8

    same_tokens = make_seq(range(9), "m", salt="tenant-a")
    BlockManager(16, BS, "another-model").match_prefix(same_tokens)
    assert not set(same_tokens.block_hashes) & set(tenant_a.block_hashes)


def test_hash_is_stable_across_processes():
    keys = (MODEL, "tenant-a")
    here = hash_blocks(list(range(12)), BS, keys)
    code = f"from rayapp.engine.kv_events import hash_blocks; print(hash_blocks(list(range(12)), {BS}, {keys!r}))"
    # A different PYTHONHASHSEED: the block hash must not depend on Python's per-process `hash`.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(here)
    # Pinned: replicas of different builds must agree, so a change of packing is a deliberate act.
    assert hash_block(None, [1, 2, 3, 4], ("smollm2", "tenant-a")) == 9228015951960448914


def test_freed_blocks_stay_revivable_until_reused():
    bm = BlockManager(4, BS, MODEL)
    first, first_pages = finished(bm, range(9))
    assert (bm.num_free_pages, bm.num_cached_pages, bm.num_used_pages) == (4, 2, 0)

    second = make_seq(range(9), "second")
    assert admit(bm, second).page_ids == tuple(first_pages[:2])
    assert bm.num_cached_pages == 0  # revived: in use again
    bm.free(second)
    bm.take_events()

    hog = make_seq(range(100, 113), "hog")  # needs all four pages
    assert admit(bm, hog) is not None
    assert removed_hashes(bm.take_events()) == set(first.block_hashes[:2])
    assert bm.match_prefix(make_seq(range(9), "third")) == PrefixMatch()


def test_tail_blocks_are_evicted_first():
    bm = BlockManager(4, BS, MODEL)
    first, _ = finished(bm, range(13))  # three full blocks and one token: all four pages

    admit(bm, make_seq(range(100, 105), "next"))  # two pages: the partial page, then block 2's
    assert removed_hashes(bm.take_events()) == {first.block_hashes[2]}
    assert bm.match_prefix(make_seq(range(13), "again")).num_tokens == 8  # the head survived


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS, MODEL)
    finished(bm, range(9))
    state = pool_state(bm)

    # 2 cached blocks + 3 new pages: the cached pages being revived are not free for the new ones.
    too_long = make_seq([*range(8), *range(50, 60)], "too-long")
    match = bm.match_prefix(too_long)
    assert match.num_tokens == 8
    assert not bm.allocate(too_long, too_long.num_tokens - match.num_tokens, match)
    assert pool_state(bm) == state
    assert (too_long.block_table, too_long.num_computed_tokens, bm.take_events()) == ([], 0, [])

    fits = make_seq([*range(8), *range(50, 56)], "fits")  # 2 revived + 2 new pages
    assert admit(bm, fits).num_tokens == 8
    assert bm.num_free_pages == 0


def test_events_describe_every_cache_change():
    bm = BlockManager(8, BS, MODEL)
    seq = make_seq(range(9), "seq")
    admit(bm, seq)
    h = hash_blocks(list(range(12)), BS, (MODEL, ""))
    assert bm.take_events() == [BlockStored((h[0], h[1]), None, tuple(range(8)), BS)]

    for token in (9, 10, 11):  # decode until block 2 is full of computed tokens
        seq.append_token(token)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert bm.take_events() == [BlockStored((h[2],), h[1], (8, 9, 10, 11), BS)]
    assert [e.block_hashes for e in bm.snapshot()] == [(h[0],), (h[1],), (h[2],)]

    assert not bm.reset_prefix_cache()  # still in use
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllCleared()]
    assert bm.num_cached_pages == 0 and bm.match_prefix(make_seq(range(9), "after")) == PrefixMatch()


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(4, BS, MODEL)
    parent = make_seq(range(10), "parent")
    admit(bm, parent)
    child = make_seq(range(10), "child")
    result = bm.fork(parent, child)
    assert result.ok and child.num_computed_tokens == 10
    assert child.block_table[:2] == parent.block_table[:2]
    assert result.copies == (PageCopy(parent.block_table[2], child.block_table[2]),)
    assert [bm.page_info(p).ref_count for p in child.block_table] == [2, 2, 1]

    # No page left for another child's partial block: reported, and nothing changed.
    second = make_seq(range(10), "second")
    assert bm.fork(parent, second).ok is False
    assert second.block_table == [] and bm.page_info(parent.block_table[0]).ref_count == 2


def test_block_computed_twice_keeps_one_cache_entry():
    bm = BlockManager(8, BS, MODEL)
    both = [make_seq(range(6), "a"), make_seq(range(6), "b")]
    for seq in both:  # both admitted before either is computed: both miss
        assert bm.allocate(seq, seq.num_tokens, bm.match_prefix(seq))
    for seq in both:
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        bm.free(seq)
    assert len(bm.take_events()) == 1 and bm.num_cached_pages == 1


def test_stale_prefix_match_is_a_loud_bug():
    bm = BlockManager(3, BS, MODEL)
    finished(bm, range(9))
    late = make_seq(range(9), "late")
    stale = bm.match_prefix(late)
    finished(bm, range(100, 109), "hog")  # reuses the matched pages before `late` takes them
    with pytest.raises(RuntimeError, match="stale PrefixMatch"):
        bm.allocate(late, 1, stale)


def test_prefix_caching_disabled_never_shares():
    bm = BlockManager(8, BS, MODEL, enable_prefix_caching=False)
    first = make_seq(range(9), "first")
    admit(bm, first)
    bm.free(first)
    assert bm.take_events() == [] and bm.num_cached_pages == 0
    assert bm.match_prefix(make_seq(range(9), "second")) == PrefixMatch()


# ---- stateful model check ----

NUM_PAGES = 8
# Prompts are cuts of these plus a short tail over a 3-token alphabet, so prefixes are often shared.
BASES = ((1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 3, 3, 3, 3, 2, 2, 1, 1), (2,) * 10)
SALTS = ("", "", "tenant-b")
tokens_st = st.integers(1, 3)
prompts_st = st.builds(
    lambda base, cut, tail: [*base[:cut], *tail],
    st.sampled_from(BASES),
    st.integers(0, 14),
    st.lists(tokens_st, min_size=1, max_size=5),
)


def kv_of(seq: Sequence, pos: int) -> tuple[str, tuple[int, ...]]:
    """The simulated K/V of `seq`'s token `pos`: it depends on the salt and every token up to it."""
    return (seq.cache_salt, tuple(seq.token_ids[: pos + 1]))


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager as a scheduler would, writing a simulated KV into the pages.

    `kv[page][slot]` holds `(salt, token prefix)`: the prefix whose last token's K/V the slot
    holds. Every served page must hold exactly the requesting sequence's KV.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_PAGES, BS, MODEL)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # preempted: no pages, computed count reset
        self.kv: dict[int, list[tuple[str, tuple[int, ...]] | None]] = {p: [None] * BS for p in range(NUM_PAGES)}
        self.index: set[BlockHash] = set()  # what a router learns from the events
        # Naive model: (salt, token prefix of whole blocks) <-> hash of its last block.
        self.naive: dict[tuple[str, tuple[int, ...]], BlockHash] = {}
        self.block_of: dict[BlockHash, tuple[str, tuple[int, ...]]] = {}
        self.next_id = 0

    def _new_seq(self, tokens: list[int], salt: str) -> Sequence:
        self.next_id += 1
        seq = make_seq(tokens, f"seq{self.next_id}", salt)
        self._register(seq)
        return seq

    def _register(self, seq: Sequence) -> None:
        salt = seq.cache_salt
        for end in range(BS, seq.num_tokens + 1, BS):
            prefix = tuple(seq.token_ids[:end])
            parent = self.naive[(salt, prefix[:-BS])] if end > BS else None
            h = self.naive[(salt, prefix)] = hash_block(parent, prefix[-BS:], (MODEL, salt))
            self.block_of[h] = (salt, prefix)

    def _compute(self, seq: Sequence, n: int, sampled: int) -> None:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            page = seq.block_table[pos // BS]
            assert self.bm.page_info(page).ref_count == 1, "wrote into a shared page"
            self.kv[page][pos % BS] = kv_of(seq, pos)
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(sampled)
            self._register(seq)

    def _admit(self, seq: Sequence, chunk: int, sampled: int) -> bool:
        match = self.bm.match_prefix(seq)
        assert match.num_tokens < seq.num_tokens and match.num_tokens == len(match.page_ids) * BS
        for pos in range(match.num_tokens):
            assert self.kv[match.page_ids[pos // BS]][pos % BS] == kv_of(seq, pos)
        n = min(chunk, seq.num_tokens - match.num_tokens)
        before = pool_state(self.bm)
        if not self.bm.allocate(seq, n, match):
            assert pool_state(self.bm) == before and (seq.block_table, seq.num_computed_tokens) == ([], 0)
            return False
        assert tuple(seq.block_table[: len(match.page_ids)]) == match.page_ids
        assert seq.num_computed_tokens == seq.num_cached_tokens == match.num_tokens
        self._compute(seq, n, sampled)
        self.running.append(seq)
        return True

    @rule(prompt=prompts_st, salt=st.sampled_from(SALTS), chunk=st.integers(1, 20), sampled=tokens_st)
    def admit_new(self, prompt, salt, chunk, sampled):
        self._admit(self._new_seq(prompt, salt), chunk, sampled)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 50), chunk=st.integers(1, 20), sampled=tokens_st)
    def readmit_preempted(self, i, chunk, sampled):
        seq = self.waiting[i % len(self.waiting)]
        if self._admit(seq, chunk, sampled):
            self.waiting.remove(seq)

    @precondition(lambda self: self.running)
    @rule(chunk=st.integers(1, 8), sampled=tokens_st)
    def engine_step(self, chunk, sampled):
        """Each running sequence prefills a chunk or decodes a token; out of pages, it is preempted."""
        for seq in list(self.running):
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            before, table = pool_state(self.bm), list(seq.block_table)
            if self.bm.allocate(seq, n):
                assert seq.block_table[: len(table)] == table  # block tables are append-only
                self._compute(seq, n, sampled)
            else:  # preemption by recompute, as the scheduler does it
                assert pool_state(self.bm) == before and seq.block_table == table
                self.bm.free(seq)
                seq.num_computed_tokens = 0
                self.running.remove(seq)
                self.waiting.append(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50), sampled=tokens_st)
    def fork(self, i, sampled):
        parent = self.running[i % len(self.running)]
        child = self._new_seq([*parent.token_ids[: parent.num_computed_tokens], sampled], parent.cache_salt)
        result = self.bm.fork(parent, child)
        if not result.ok:
            assert child.block_table == [] and self.bm.num_free_pages == 0
            return
        for copy in result.copies:
            self.kv[copy.dst_page] = list(self.kv[copy.src_page])
        assert child.num_computed_tokens == parent.num_computed_tokens
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def finish(self, i):
        self.bm.free(self.running.pop(i % len(self.running)))

    @rule(num_blocks=st.integers(1, NUM_PAGES), roll=st.integers(0, 2))
    def memory_pressure(self, num_blocks, roll):
        """A one-off long prompt that evicts whatever the LRU order says, then finishes."""
        if roll != 1:  # rarer than the other rules, or little would stay cached to share
            return
        hog = self._new_seq([100 + self.next_id] * (num_blocks * BS), "")
        if self._admit(hog, num_blocks * BS, 1):
            self.running.remove(hog)
            self.bm.free(hog)

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll != 3:  # rare, as in a server (hypothesis favours 0 and the bounds, hence not `if roll`)
            return
        in_use = self.bm.num_used_pages > 0
        assert self.bm.reset_prefix_cache() is not in_use
        if not in_use:
            assert self.bm.num_cached_pages == 0

    @invariant()
    def events_mirror_the_cache(self):
        for event in self.bm.take_events():
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * BS
                parent = event.parent_block_hash
                for j, h in enumerate(event.block_hashes):
                    salt, prefix = self.block_of[h]
                    assert prefix[-BS:] == event.token_ids[j * BS : (j + 1) * BS]
                    assert parent == (self.naive[(salt, prefix[:-BS])] if len(prefix) > BS else None)
                    assert h not in self.index
                    self.index.add(h)
                    parent = h
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.index
                self.index -= set(event.block_hashes)
            else:
                assert isinstance(event, AllCleared)
                self.index.clear()
        snapshot = self.bm.snapshot()
        order = {e.block_hashes[0]: k for k, e in enumerate(snapshot)}
        assert set(order) == self.index
        assert all(order.get(e.parent_block_hash, -1) < order[e.block_hashes[0]] for e in snapshot)  # parents first

    @invariant()
    def pages_are_accounted_for(self):
        self.bm.check_invariants()
        infos = [self.bm.page_info(p) for p in range(NUM_PAGES)]
        tables = [seq.block_table for seq in self.running]
        assert all(len(set(t)) == len(t) for t in tables) and not any(seq.block_table for seq in self.waiting)
        assert [i.ref_count for i in infos] == [sum(p in t for t in tables) for p in range(NUM_PAGES)]
        assert self.bm.num_free_pages == sum(i.ref_count == 0 for i in infos)
        assert self.bm.num_used_pages == NUM_PAGES - self.bm.num_free_pages
        assert self.bm.num_cached_pages == sum(i.ref_count == 0 and i.block_hash is not None for i in infos)

    @invariant()
    def every_page_holds_the_kv_it_claims(self):
        for seq in self.running:  # its table covers every computed token, each with its own K/V
            for pos in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[pos // BS]][pos % BS] == kv_of(seq, pos)
        for p in range(NUM_PAGES):
            info = self.bm.page_info(p)
            if info.block_hash is None:
                continue
            salt, prefix = self.block_of[info.block_hash]
            assert info.token_ids == prefix[-BS:]
            assert self.kv[p] == [(salt, prefix[: len(prefix) - BS + j + 1]) for j in range(BS)]

    def teardown(self):
        for seq in self.running:
            self.bm.free(seq)
        self.bm.check_invariants()
        assert (self.bm.num_free_pages, self.bm.num_used_pages) == (NUM_PAGES, 0)
        assert self.bm.reset_prefix_cache() and self.bm.num_cached_pages == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
