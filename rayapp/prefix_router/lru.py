"""`LeafLRU`: the PrefixIndex's eviction order, the least recently used leaf of a forest first, found without a scan.

Only a leaf may go (a kept node's parent is always kept), so a plain LRU list would have to skip
the inner nodes at its head, which in a chain-shaped index are most of them:
- Every node sits in one recency list (circular, oldest first, slot 0 its sentinel), except the
  parked ones. Eviction looks at the list's head: a leaf goes; an inner node (it cannot go while
  it has children) is parked, taken off the list. A touched node goes (back) to the list's tail.
- A parked node is older than every listed node: it was the oldest listed node when parked, and
  the list only gains newer ones. So when a parked node becomes a leaf (its last child went), it
  is queued in a heap by the order it was parked in, and eviction takes from that heap first.
Each node is parked at most once per touch, so an eviction costs O(1) amortized (O(log queued)
for a queued one), whatever the forest's size.
"""

from __future__ import annotations

import heapq
from array import array

SENTINEL = 0  # slot 0: the recency list's head and tail, never a node
# Where a slot stands in the eviction order.
_LISTED, _PARKED, _QUEUED, _FREE = 0, 1, 2, 3
_SLOT_BITS = 32  # a queued entry is park number << _SLOT_BITS | slot
_SLOT_MASK = (1 << _SLOT_BITS) - 1


class LeafLRU:
    """Recency of the slots of a forest whose child counts its owner keeps in `children` (shared, read here).

    The owner calls `add` for a new node, `touch`/`touch_path` when nodes are used, `orphaned` when a
    node's last child went, `remove` when a node goes, and `grow` with its own per-slot columns.
    """

    def __init__(self, children: array) -> None:
        self.children = children
        self.prev = array("i", [SENTINEL])
        self.next = array("i", [SENTINEL])
        self.state = array("B", [_LISTED])
        self.parked_as = array("q", [0])  # a parked node's park number
        self._parked = 0
        self._queued: list[int] = []  # parked leaves, a heap by park number
        # Nodes eviction has looked at (evicted, parked, or found stale): its cost, for tests and benchmarks.
        self.visits = 0

    def grow(self, extra: int) -> None:
        for column in (self.prev, self.next, self.parked_as):
            column.frombytes(bytes(extra * column.itemsize))
        self.state.frombytes(bytes([_FREE]) * extra)

    def add(self, s: int) -> None:
        """A new node: the most recently used."""
        prev, nxt = self.prev, self.next
        tail = prev[SENTINEL]
        prev[s], nxt[s], nxt[tail], prev[SENTINEL] = tail, SENTINEL, s, s
        self.state[s] = _LISTED

    def touch(self, s: int) -> None:
        if self.state[s] == _LISTED:
            self._unlink(s)
        self.add(s)  # a parked node rejoins the list; its queued entry (if any) is now stale

    def touch_path(self, path: list[int]) -> None:
        """`touch` of each node of `path` in turn: runs already adjacent in the list (a chain stored or
        matched together before) move to the tail in one splice."""
        prev, nxt, state = self.prev, self.next, self.state
        i, count = 0, len(path)
        while i < count:
            first = last = path[i]
            i += 1
            if state[first] != _LISTED:
                self.add(first)
                continue
            while i < count and nxt[last] == path[i]:
                last = path[i]
                i += 1
            after = nxt[last]
            if after == SENTINEL:  # the run is the list's tail already
                continue
            before, tail = prev[first], prev[SENTINEL]
            nxt[before], prev[after] = after, before
            prev[first], nxt[tail], nxt[last], prev[SENTINEL] = tail, first, SENTINEL, last

    def orphaned(self, s: int) -> None:
        """`s` lost its last child: a leaf now, evictable in its turn."""
        if self.state[s] == _PARKED:
            self.state[s] = _QUEUED
            heapq.heappush(self._queued, self.parked_as[s] << _SLOT_BITS | s)

    def remove(self, s: int) -> None:
        if self.state[s] == _LISTED:
            self._unlink(s)
        self.state[s] = _FREE

    def oldest_leaf(self) -> int:
        """The least recently used node without children (the caller removes it)."""
        queued, state, parked_as, children = self._queued, self.state, self.parked_as, self.children
        while queued:
            self.visits += 1
            entry = heapq.heappop(queued)
            s = entry & _SLOT_MASK
            # Stale entries (touched or removed since, or parked again) are skipped.
            if state[s] == _QUEUED and parked_as[s] == entry >> _SLOT_BITS:
                if not children[s]:
                    return s
                state[s] = _PARKED  # it gained a child since: `orphaned` queues it again
        while True:
            self.visits += 1
            s = self.next[SENTINEL]
            if s == SENTINEL:
                raise AssertionError("no evictable leaf: the forest's parent links form a cycle")
            if not children[s]:
                return s
            self._unlink(s)
            # Nodes are parked oldest first: the order they are parked in is their recency order.
            state[s], parked_as[s] = _PARKED, self._parked
            self._parked += 1

    def _unlink(self, s: int) -> None:
        p, n = self.prev[s], self.next[s]
        self.next[p], self.prev[n] = n, p
