"""BlockManager against a model: random admit / decode / fork / free / eviction sequences keep
every invariant, and every page served holds exactly the requesting sequence's K/V."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, hash_block
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.sequence import Sequence

BS = 4
MODEL = "smollm2"


def make_seq(tokens, seq_id: str, salt: str = "") -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(), cache_salt=salt)


def pool_state(bm: BlockManager) -> tuple:
    return bm.num_free_pages, bm.num_cached_pages, [bm.page_info(p) for p in bm.page_ids]


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
        self.kv: dict[int, list[tuple[str, tuple[int, ...]] | None]] = {p: [None] * BS for p in self.bm.page_ids}
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
        infos = [self.bm.page_info(p) for p in self.bm.page_ids]
        tables = [seq.block_table for seq in self.running]
        assert all(len(set(t)) == len(t) for t in tables) and not any(seq.block_table for seq in self.waiting)
        assert [i.ref_count for i in infos] == [sum(p in t for t in tables) for p in self.bm.page_ids]
        assert self.bm.num_free_pages == sum(i.ref_count == 0 for i in infos)
        assert self.bm.num_used_pages == NUM_PAGES - self.bm.num_free_pages
        assert self.bm.num_cached_pages == sum(i.ref_count == 0 and i.block_hash is not None for i in infos)

    @invariant()
    def every_page_holds_the_kv_it_claims(self):
        for seq in self.running:  # its table covers every computed token, each with its own K/V
            for pos in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[pos // BS]][pos % BS] == kv_of(seq, pos)
        for p in self.bm.page_ids:
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
