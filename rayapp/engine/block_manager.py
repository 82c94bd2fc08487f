"""Page accounting for one replica's KV cache: ref counts, prefix caching, lazy LRU eviction.

The BlockManager hands out page ids 1..num_pages (the `KVPool`'s main region; page 0 is the null page,
never handed out); it never touches tensors. Every change to the set of cached blocks is reported as a `KVEvent`.

Invariants (checked by `check_invariants`):
- a page is in the free list iff its ref count is 0;
- a page holds a block hash iff `_cached[hash]` is that page (at most one page per hash);
- only pages full of computed tokens hold a hash, and they keep it after being freed (lazy
  eviction) until the free list hands them out again.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, KVEvent, hash_blocks
from rayapp.engine import pages
from rayapp.engine.pages import NULL_PAGE, OFFLOADED, ForkResult, FreeBlockQueue, Page, PageCopy, PageInfo, PrefixMatch
from rayapp.engine.sequence import Sequence


class BlockManager:
    """Hands out KV pages to sequences, shares full blocks between them, caches freed ones.

    Contract with the engine: every sequence that got pages is eventually passed to `free`;
    `seq.token_ids` only grows (hashes of its full blocks are kept in `seq.block_hashes`); the
    engine advances `seq.num_computed_tokens` and then calls `cache_full_blocks`.
    """

    def __init__(self, num_pages: int, block_size: int, model_id: str, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1 or block_size < 1:
            raise ValueError(f"num_pages={num_pages} and block_size={block_size} must both be >= 1")
        # Read-only after construction.
        self.num_pages = num_pages
        self.block_size = block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        # Indexed by page id; the null page is here only so that ids index the list, and is never free.
        self._pages = [Page(i) for i in range(NULL_PAGE, num_pages + 1)]
        self._free = FreeBlockQueue(self._pages[NULL_PAGE + 1 :])
        self._cached: dict[BlockHash, Page] = {}
        # Free pages that still hold a hash, kept as a counter so `num_cached_pages` is O(1).
        self._num_cached_free = 0
        # seq_id -> leading blocks of its table that `cache_full_blocks` has already handled, so
        # a decode step looks only at new blocks instead of rescanning the whole table.
        self._num_handled_blocks: dict[str, int] = {}
        self._events: list[KVEvent] = []
        # Called with each BlockStored this manager emits for computed blocks and the sequence's cache salt
        # (the cluster tier's write-through); not for blocks adopted from the tier.
        self.on_stored: Callable[[BlockStored, str], None] | None = None

    @property
    def page_ids(self) -> range:
        """The ids of the pages this manager hands out."""
        return range(NULL_PAGE + 1, self.num_pages + 1)

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence references, cached (revivable) ones included."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold a cached block and can be revived by a prefix match."""
        return self._num_cached_free

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - len(self._free)

    def match_prefix(self, seq: Sequence, start: PrefixMatch | None = None) -> PrefixMatch:
        """Longest run of cached pages holding `seq`'s leading full blocks; changes no page. With `start` (a match
        of `seq` in this step, which blocks adopted since may continue), the run continues it.

        At most `seq.num_tokens - seq.min_recompute_tokens` tokens match (at least the last one must be
        computed to get logits). A hit
        requires the stored token ids and parent hash to equal the sequence's, so a colliding hash
        alone never serves another block's KV. Empty when prefix caching is off or `seq` holds pages.
        Fills `seq.block_hashes` for the prompt's full blocks. Pages of `seq.host_pages` (K/V in the sparse
        host pool) match as `OFFLOADED` once every page before them matched."""
        if not self.enable_prefix_caching or seq.block_table:
            return PrefixMatch()
        hashes = self._hash_full_blocks(seq)
        page_ids = [] if start is None else list(start.page_ids)
        for i in range(len(page_ids), (seq.num_tokens - max(1, seq.min_recompute_tokens)) // self.block_size):
            if i in seq.host_pages:
                page_ids.append(OFFLOADED)
                continue
            page = self._cached.get(hashes[i])
            if page is None or not self._holds_block(page, seq, i):
                break
            page_ids.append(page.page_id)
        return PrefixMatch(tuple(page_ids), len(page_ids) * self.block_size)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` now full of computed tokens and not yet cached.

        When another page already caches the same block (e.g. a recomputed last block), that
        entry is kept and this page stays uncached. Emits one `BlockStored` per chained run.
        """
        if not self.enable_prefix_caching or seq.compacted:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full > len(seq.block_table):
            raise RuntimeError(f"sequence {seq.seq_id} computed tokens past its pages: allocate before computing")
        start = self._num_handled_blocks.get(seq.seq_id, 0)
        hashes = self._hash_full_blocks(seq)
        run: list[int] = []  # consecutive block indices stored by this call, sent as one event
        for i in range(start, num_full):
            page = self._pages[seq.block_table[i]]
            if page.block_hash is not None or hashes[i] in self._cached:
                self._emit_stored(seq, run)
                run = []
                continue
            page.block_hash = hashes[i]
            page.parent_hash = hashes[i - 1] if i else None
            page.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._cached[hashes[i]] = page
            run.append(i)
        self._emit_stored(seq, run)
        self._num_handled_blocks[seq.seq_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (and nothing dropped) while any page is referenced."""
        if self.num_used_pages:
            return False
        for page in self._cached.values():
            page.block_hash = page.parent_hash = page.token_ids = None
        self._cached.clear()
        self._num_cached_free = 0
        self._events.append(AllCleared())
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Grow `seq.block_table` to cover `num_computed_tokens + num_new_tokens` tokens.

        With `prefix` (fresh admission: `seq` holds no pages) the matched pages come first and
        `seq.num_computed_tokens = seq.num_cached_tokens = prefix.num_tokens`. All or nothing: returns False
        and changes nothing when too few pages are free (`_pages_needed`). Reusing a cached free page evicts its
        block."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be >= 0")
        if prefix is not None:
            self._check_prefix(seq, prefix)
        num_needed = self._pages_needed(seq, num_new_tokens, prefix)
        if num_needed is None:
            return False
        if prefix is not None:
            for pid in prefix.page_ids:
                if pid != OFFLOADED:
                    self._take_ref(self._pages[pid])
            seq.block_table = list(prefix.page_ids)
            seq.num_computed_tokens = seq.num_cached_tokens = prefix.num_tokens
            self._num_handled_blocks[seq.seq_id] = len(prefix.page_ids)
        seq.block_table.extend(self._pop_free_pages(num_needed))
        return True

    def fits(self, seq: Sequence, prefix: PrefixMatch) -> bool:
        """Whether all of `seq` fits in the pool now from `prefix` on (checked before adopting outside blocks)."""
        return self._pages_needed(seq, seq.num_tokens - prefix.num_tokens, prefix) is not None

    def _pages_needed(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None) -> int | None:
        """Free pages `allocate` takes, None when too few are free (pages `prefix` revives do not count)."""
        if prefix is None:
            num_computed, num_have, num_reviving = seq.num_computed_tokens, len(seq.block_table), 0
        else:
            num_computed, num_have = prefix.num_tokens, len(prefix.page_ids)
            num_reviving = sum(1 for pid in prefix.page_ids if pid != OFFLOADED and self._pages[pid].ref_count == 0)
        num_needed = max(0, -(-(num_computed + num_new_tokens) // self.block_size) - num_have)
        return None if num_needed > len(self._free) - num_reviving else num_needed

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> ForkResult:
        """Give `child` (no pages yet, same first tokens and salt) the KV of `parent`'s first `num_tokens`
        computed tokens (default: all of them), and that computed count.

        Full blocks are shared (ref +1); a partial last block gets a fresh page, returned as a
        `PageCopy` the engine must perform before either sequence writes to it.
        """
        n = parent.num_computed_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= parent.num_computed_tokens:
            raise ValueError(f"fork of {n} tokens, but {parent.seq_id} has computed {parent.num_computed_tokens}")
        num_full, partial = divmod(n, self.block_size)
        if child.block_table:
            raise RuntimeError(f"fork target {child.seq_id} already holds pages")
        if child.cache_salt != parent.cache_salt or child.token_ids[:n] != parent.token_ids[:n]:
            raise ValueError(f"fork child {child.seq_id} needs the parent's cache salt and first {n} tokens")
        if partial and not self._free:
            return ForkResult(ok=False)
        shared = parent.block_table[:num_full]
        for pid in shared:
            self._take_ref(self._pages[pid])
        child.block_table = list(shared)
        copies: tuple[PageCopy, ...] = ()
        if partial:
            (dst,) = self._pop_free_pages(1)
            child.block_table.append(dst)
            copies = (PageCopy(parent.block_table[num_full], dst),)
        child.num_computed_tokens = n
        if len(child.block_hashes) < num_full:
            child.block_hashes = list(parent.block_hashes[:num_full])
        self._num_handled_blocks[child.seq_id] = min(self._num_handled_blocks.get(parent.seq_id, 0), num_full)
        return ForkResult(ok=True, copies=copies)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s pages, last block first, and its carrier pages; empty both lists.

        Pages reaching ref 0 join the free list's tail, keeping their cached block: a sequence's
        tail blocks thus sit before its head blocks and are evicted first."""
        for pid in chain(reversed(seq.block_table), seq.carrier_pages):
            if pid == OFFLOADED:
                continue
            if self._pages[pid].ref_count <= 0:
                raise RuntimeError(f"page {pid} of sequence {seq.seq_id} freed more often than taken")
            self._drop_ref(self._pages[pid])
        seq.block_table, seq.carrier_pages = [], []
        self._num_handled_blocks.pop(seq.seq_id, None)

    def allocate_carriers(self, seq: Sequence, n: int) -> list[int] | None:
        """`n` more carrier pages for `seq`'s compacted KV (appended to `seq.carrier_pages`), or None (nothing
        changed) when too few pages are free.

        The first call compacts `seq`: its token pages are released as `free` releases them (cached blocks stay
        revivable, and the pages only `seq` held count as free here) and its `block_table` empties. Carrier
        pages are taken LRU first, the released ones last, and are never cached: they do not map token
        positions."""
        only_here = [pid for pid in seq.block_table if pid != OFFLOADED and self._pages[pid].ref_count == 1]
        if n > len(self._free) + len(only_here):  # a compacted sequence's block_table is empty
            return None
        if not seq.compacted:
            self.free(seq)
        pages = self._pop_free_pages(n)
        seq.carrier_pages.extend(pages)
        return pages

    def release_pages(self, seq: Sequence, block_indices: list[int]) -> None:
        """Drop `seq`'s reference to the pages of these blocks (their K/V now lives in the host pool).

        The entries become `OFFLOADED`; the table keeps its length, so token positions still map
        to table indices. Only full, cached-or-computed blocks before the last one may be released.
        """
        for i in block_indices:
            pid = seq.block_table[i]
            if pid == OFFLOADED or i >= seq.num_computed_tokens // self.block_size:
                raise RuntimeError(f"block {i} of {seq.seq_id} is not a computed, device-resident block")
            self._drop_ref(self._pages[pid])
            seq.block_table[i] = OFFLOADED

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[BlockStored]:
        """One `BlockStored` per cached block, parents first: what an event consumer that saw a gap rebuilds from."""
        return pages.cached_chains(self._cached, self.block_size)

    def page_info(self, page_id: int) -> PageInfo:
        """Ref count and cached block (if any) of page `page_id`."""
        page = self._pages[page_id]
        return PageInfo(page.ref_count, page.block_hash, page.token_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal bookkeeping is inconsistent. O(num_pages)."""
        pages = [self._pages[i] for i in self.page_ids]
        free_ids = [page.page_id for page in self._free]
        unreferenced = [p.page_id for p in pages if p.ref_count == 0]
        hashed = [p for p in pages if p.block_hash is not None]
        null = self._pages[NULL_PAGE]
        checks = {
            "the null page was handed out": (null.ref_count, null.block_hash) == (0, None),
            "a ref count is negative": all(p.ref_count >= 0 for p in pages),
            "free list length differs from its counter": len(free_ids) == len(self._free),
            "free list differs from the unreferenced pages": sorted(free_ids) == unreferenced,
            "a page holds a hash that is not its cache entry": len(hashed) == len(self._cached),
            "a cache entry points at the wrong page": all(self._cached.get(p.block_hash) is p for p in hashed),
            "a cached page is not a full block": all(len(p.token_ids or ()) == self.block_size for p in hashed),
            "cached free page counter is off": sum(p.ref_count == 0 for p in hashed) == self._num_cached_free,
        }
        for message, ok in checks.items():
            if not ok:
                raise AssertionError(message)

    def _hash_full_blocks(self, seq: Sequence) -> list[BlockHash]:
        """Extend `seq.block_hashes` to every full block of its tokens (token ids only grow)."""
        bs, hashes = self.block_size, seq.block_hashes
        start, end = len(hashes) * bs, seq.num_tokens // bs * bs  # tokens hashed so far, in full blocks
        if start < end:
            keys = (self.model_id, seq.cache_salt)
            hashes.extend(hash_blocks(seq.token_ids[start:end], bs, keys, hashes[-1] if hashes else None))
        return hashes

    def _holds_block(self, page: Page, seq: Sequence, i: int) -> bool:
        bs = self.block_size
        parent = seq.block_hashes[i - 1] if i else None
        return page.parent_hash == parent and page.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def _check_prefix(self, seq: Sequence, prefix: PrefixMatch) -> None:
        # A stale match (pages reused since `match_prefix`) is a scheduler bug: fail loudly, serve no other's KV.
        if seq.block_table:
            raise RuntimeError(f"allocate with a prefix is for admission, but {seq.seq_id} already holds pages")
        stale = prefix.num_tokens != len(prefix.page_ids) * self.block_size or any(
            i >= len(seq.block_hashes)
            or (self._pages[pid].block_hash != seq.block_hashes[i] if pid != OFFLOADED else i not in seq.host_pages)
            for i, pid in enumerate(prefix.page_ids)
        )
        if stale:
            raise RuntimeError(f"stale PrefixMatch for {seq.seq_id}: call match_prefix right before allocate")

    def _take_ref(self, page: Page) -> None:
        if page.ref_count == 0:  # revive: a free (possibly cached) page goes back in use
            self._free.remove(page)
            if page.block_hash is not None:
                self._num_cached_free -= 1
        page.ref_count += 1

    def _drop_ref(self, page: Page) -> None:
        page.ref_count -= 1
        if page.ref_count == 0:  # to the free list's tail, its cached block (if any) kept
            self._free.append(page)
            if page.block_hash is not None:
                self._num_cached_free += 1

    def _pop_free_pages(self, n: int) -> list[int]:
        """Take `n` LRU free pages (caller checked there are enough); evict their cached blocks."""
        page_ids: list[int] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            page = self._free.popleft()
            if page.block_hash is not None:
                evicted.append(page.block_hash)
                del self._cached[page.block_hash]
                page.block_hash = page.parent_hash = page.token_ids = None
                self._num_cached_free -= 1
            page.ref_count = 1
            page_ids.append(page.page_id)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return page_ids

    def _emit_stored(self, seq: Sequence, run: list[int]) -> None:
        if not run:
            return
        bs, hashes = self.block_size, seq.block_hashes
        parent = hashes[run[0] - 1] if run[0] else None
        tokens = tuple(seq.token_ids[run[0] * bs : (run[-1] + 1) * bs])
        event = BlockStored(tuple(hashes[i] for i in run), parent, tokens, bs)
        self._events.append(event)
        if self.on_stored is not None:
            self.on_stored(event, seq.cache_salt)

    def cached_page(self, block_hash: BlockHash) -> int | None:
        """The page caching `block_hash`, or None."""
        page = self._cached.get(block_hash)
        return None if page is None else page.page_id

    def adopt_cached_blocks(
        self,
        block_hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: list[tuple[int, ...]],
        keep: tuple[int, ...] = (),
    ) -> list[int]:
        """Register a chain of full blocks whose KV the caller writes into the returned pages right away
        (blocks loaded from the cluster tier), as cached free pages, so the next `match_prefix` hits them.

        `block_hashes` chain on `parent`. Takes LRU free pages (evicting their blocks); adopts the leading
        blocks that are not cached yet, at most as many as pages are free. The chain's head ends most
        recently freed, so it is evicted last, as `free` would leave it. Emits one `BlockStored`. The pages
        `keep` (the local prefix the chain continues) are not evicted for it and end more recent still.
        """
        kept = [self._pages[pid] for pid in keep]
        for page in kept:
            self._take_ref(page)
        n = 0
        while self.enable_prefix_caching and n < min(len(block_hashes), len(self._free)):
            if block_hashes[n] in self._cached:
                break
            n += 1
        pages = [self._pages[pid] for pid in self._pop_free_pages(n)]
        for i in reversed(range(n)):
            page = pages[i]
            page.block_hash = block_hashes[i]
            page.parent_hash = block_hashes[i - 1] if i else parent
            page.token_ids = tuple(token_ids[i])
            self._cached[page.block_hash] = page
            page.ref_count = 0
            self._free.append(page)
            self._num_cached_free += 1
        for page in reversed(kept):
            self._drop_ref(page)
        if pages:
            tokens = tuple(t for ids in token_ids[: len(pages)] for t in ids)
            self._events.append(BlockStored(tuple(block_hashes[: len(pages)]), parent, tokens, self.block_size))
        return [page.page_id for page in pages]
