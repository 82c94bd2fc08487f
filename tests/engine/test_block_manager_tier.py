"""BlockManager hooks of the cluster KV tier: blocks adopted from the tier, and the write-through callback."""

from __future__ import annotations

from rayapp.blocks import BlockRemoved, BlockStored, hash_blocks
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.sequence import Sequence

BS = 4
MODEL = "smollm2"


def make_seq(tokens, seq_id: str = "s", salt: str = "") -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(), cache_salt=salt)


def blocks_of(tokens):
    return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) // BS * BS, BS)]


def test_adopted_blocks_are_hit_by_the_next_prefix_match():
    bm = BlockManager(num_pages=8, block_size=BS, model_id=MODEL)
    tokens = list(range(100, 117))  # 4 full blocks + 1 token
    hashes = hash_blocks(tokens, BS, (MODEL, ""))
    pages = bm.adopt_cached_blocks(hashes, None, blocks_of(tokens))
    assert len(pages) == 4 and bm.num_cached_pages == 4 and bm.num_used_pages == 0
    assert bm.take_events() == [BlockStored(tuple(hashes), None, tuple(tokens[:16]), BS)]
    match = bm.match_prefix(make_seq(tokens))
    assert match.page_ids == tuple(pages) and match.num_tokens == 16
    # Adopting again finds them cached: nothing taken twice.
    assert bm.adopt_cached_blocks(hashes, None, blocks_of(tokens)) == []
    bm.check_invariants()


def test_adoption_continues_the_local_prefix_without_evicting_it():
    bm = BlockManager(num_pages=4, block_size=BS, model_id=MODEL)
    tokens = list(range(200, 217))
    hashes = hash_blocks(tokens, BS, (MODEL, ""))
    local = make_seq(tokens[:9], "local")  # computes blocks 0 and 1, then finishes
    bm.allocate(local, 9)
    local.num_computed_tokens = 9
    bm.cache_full_blocks(local)
    bm.free(local)
    scratch = make_seq(list(range(8)), "scratch")  # takes and frees the 2 other pages, computing nothing
    bm.allocate(scratch, 8)
    bm.free(scratch)
    bm.take_events()
    keep = bm.match_prefix(make_seq(tokens)).page_ids
    assert len(keep) == 2
    # 4 pages: the local prefix's 2 are the LRU ones, yet only the 2 others may be taken.
    pages = bm.adopt_cached_blocks(hashes[2:], hashes[1], blocks_of(tokens)[2:], keep=keep)
    assert len(pages) == 2 and not set(pages) & set(keep)
    assert bm.match_prefix(make_seq(tokens)).num_tokens == 16
    assert not any(isinstance(e, BlockRemoved) for e in bm.take_events())
    bm.check_invariants()


def test_adoption_stops_at_the_free_pages_and_evicts_lru_blocks():
    bm = BlockManager(num_pages=2, block_size=BS, model_id=MODEL)
    other = make_seq(list(range(300, 305)), "other")
    bm.allocate(other, 5)
    other.num_computed_tokens = 5
    bm.cache_full_blocks(other)
    bm.free(other)
    bm.take_events()
    tokens = list(range(400, 413))
    hashes = hash_blocks(tokens, BS, (MODEL, ""))
    assert len(bm.adopt_cached_blocks(hashes, None, blocks_of(tokens))) == 2
    events = bm.take_events()
    assert isinstance(events[0], BlockRemoved) and events[1].block_hashes == tuple(hashes[:2])
    bm.check_invariants()


def test_write_through_sees_computed_blocks_with_their_salt_but_not_adopted_ones():
    bm = BlockManager(num_pages=8, block_size=BS, model_id=MODEL)
    seen = []
    bm.on_stored = lambda event, salt: seen.append((event.block_hashes, salt))
    tokens = list(range(500, 509))
    seq = make_seq(tokens, salt="tenant")
    bm.allocate(seq, 9)
    seq.num_computed_tokens = 9
    bm.cache_full_blocks(seq)
    assert seen == [(tuple(hash_blocks(tokens, BS, (MODEL, "tenant"))), "tenant")]
    more = list(range(600, 609))
    bm.adopt_cached_blocks(hash_blocks(more, BS, (MODEL, "")), None, blocks_of(more))
    assert len(seen) == 1
    assert bm.cached_page(seen[0][0][0]) == seq.block_table[0]
