"""BlockManager: prefix sharing, lazy eviction, forks and events, as the scheduler drives them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rayapp import blocks as kv_events
from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, hash_block, hash_blocks
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.pages import PageCopy, PrefixMatch
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.sequence import Sequence

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
    return bm.num_free_pages, bm.num_cached_pages, [bm.page_info(p) for p in bm.page_ids]


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
    code = f"from rayapp.blocks import hash_blocks; print(hash_blocks(list(range(12)), {BS}, {keys!r}))"
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
