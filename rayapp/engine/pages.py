"""The BlockManager's pages: each page's bookkeeping, the free list (an intrusive doubly linked LRU list, O(1)
anywhere), and the small results the BlockManager hands the scheduler and the engine."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from rayapp.blocks import BlockHash, BlockStored

# The pool's page that is never handed out (`KVPool`): table entries with no device page name it.
NULL_PAGE = 0
# A block-table entry whose page was released after its K/V moved to the host pool: the null page.
OFFLOADED = NULL_PAGE


@dataclass(frozen=True)
class PrefixMatch:
    """Cached pages holding a sequence's first `num_tokens` tokens (whole blocks), in order.

    Pass it straight to `allocate`: until then the pages are unreferenced and may be evicted.
    """

    page_ids: tuple[int, ...] = ()
    num_tokens: int = 0


class PageCopy(NamedTuple):
    """The engine must copy the KV of `src_page` into `dst_page` (all layers)."""

    src_page: int
    dst_page: int


@dataclass(frozen=True)
class ForkResult:
    """`ok` is False when no page was free for the child's partial last block (nothing changed)."""

    ok: bool
    copies: tuple[PageCopy, ...] = ()


class PageInfo(NamedTuple):
    """Read-only view of one page, for tests and debugging."""

    ref_count: int
    block_hash: BlockHash | None
    token_ids: tuple[int, ...] | None


@dataclass(eq=False, slots=True)
class Page:
    """One page's bookkeeping; the free-list links live here so removal from the middle is O(1)."""

    page_id: int
    ref_count: int = 0
    # The three below are set only while the page is the cache entry of a full block.
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    prev_free: Page | None = field(default=None, repr=False)
    next_free: Page | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked LRU list of free pages: O(1) popleft, append and remove.

    Sentinel head and tail nodes mean no operation has to special-case an end of the list.
    """

    def __init__(self, pages: list[Page]) -> None:
        self._head, self._tail = Page(-1), Page(-1)  # sentinels, never handed out
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for page in pages:
            self.append(page)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Page]:
        page = self._head.next_free
        while page is not None and page is not self._tail:
            yield page
            page = page.next_free

    def popleft(self) -> Page:
        """Remove and return the least recently freed page."""
        page = self._head.next_free
        if page is None or page is self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(page)
        return page

    def append(self, page: Page) -> None:
        """Add `page` as the most recently freed page."""
        if page.prev_free is not None or page.next_free is not None:
            raise RuntimeError(f"page {page.page_id} is already in the free list")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = page
        page.prev_free = last
        page.next_free = self._tail
        self._tail.prev_free = page
        self._len += 1

    def remove(self, page: Page) -> None:
        """Take `page` out of the list, wherever it is."""
        prev, nxt = page.prev_free, page.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"page {page.page_id} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        page.prev_free = page.next_free = None
        self._len -= 1


def cached_chains(cached: dict[BlockHash, Page], block_size: int) -> list[BlockStored]:
    """One `BlockStored` per block of `cached` (hash -> the page caching it), each after its parent."""
    ordered: list[BlockStored] = []
    seen: set[BlockHash] = set()
    for block_hash in cached:
        chain: list[BlockHash] = []
        h: BlockHash | None = block_hash
        while h is not None and h in cached and h not in seen:  # up to an emitted or uncached parent
            seen.add(h)
            chain.append(h)
            h = cached[h].parent_hash
        for h in reversed(chain):
            page = cached[h]
            ordered.append(BlockStored((h,), page.parent_hash, page.token_ids or (), block_size))
    return ordered
