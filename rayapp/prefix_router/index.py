"""`PrefixIndex`: which replica holds which prefix blocks, in which tier, fed by KV events.

A radix tree over block-hash chains. A block hash already names its whole prefix (it chains on
its parent's), so the tree is a map from hash to node plus parent links; a request's hash chain
walks it from the root in O(prefix blocks). Each node records the replicas holding that block and
the tier each holds it in. The index only learns from the engines' own events (`BlockStored` /
`BlockRemoved` / `AllCleared`), so it never guesses from text.

Layout, for fleet scale (about 150 bytes a block, where a dataclass and three dicts took ~750): a
node is a slot, an integer. `_slot` maps a block hash to its slot; parallel `array`s hold, per
slot, the parent slot, the child count and the holder, and `LeafLRU`'s recency links. Nearly every
block has one holder, kept inline as a replica id and a tier id (small tables name both); a block
several replicas hold keeps a small {replica id: tier id} dict in `_shared`.

Memory is bounded: past `max_blocks` nodes, the least recently stored-or-matched leaf is dropped,
one at a time (a leaf first, so a kept node's parent is always kept), until the index fits. `LeafLRU`
finds it without scanning, so storing into a full index costs what its batch costs (amortized),
whatever the index's size.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import repeat
from typing import NamedTuple

import numpy as np

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from rayapp.prefix_router.lru import LeafLRU

_NONE = -1  # no parent, no holder
_SHARED = -2  # several holders: see `PrefixIndex._shared`
_MIXED = 255  # the tier id of a block several replicas hold in different tiers

Row = tuple[BlockHash, "BlockHash | None", dict[str, str]]


class Overlap(NamedTuple):
    """How many leading blocks of a request each replica holds, and in which tiers."""

    blocks: int
    tiers: tuple[str, ...]


class PrefixIndex:
    """Longest cached prefix per replica for a request's block hashes.

    Not thread-safe: one owner (the PrefixIndex actor) applies events and answers matches.
    """

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks={max_blocks} must be >= 1")
        self.max_blocks = max_blocks
        self._slot: dict[BlockHash, int] = {}
        # Per slot (slot 0 is `LeafLRU`'s sentinel; a free slot's hash is None).
        self._hash: list[BlockHash | None] = [None]
        self._parent = array("i", [_NONE])
        self._children = array("i", [0])
        self._holder = array("i", [_NONE])  # replica id, _NONE or _SHARED
        self._tier = array("B", [0])  # the inline holder's tier id; of shared blocks, their one tier or _MIXED
        self._free = array("i")
        self._shared: dict[int, dict[int, int]] = {}
        self._lru = LeafLRU(self._children)
        # Replicas holding at least one block, by id; ids of replicas that hold nothing are reused.
        self._replica_id: dict[str, int] = {}
        self._replica_name: list[str | None] = []
        self._held: list[int] = []
        self._free_replicas: list[int] = []
        self._tier_id: dict[str, int] = {}
        self._tier_name: list[str] = []

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def replicas(self) -> set[str]:
        return set(self._replica_id)

    @property
    def eviction_visits(self) -> int:
        """Nodes eviction has looked at so far: its cost in nodes (one per evicted leaf, plus parked ones)."""
        return self._lru.visits

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        """Apply one replica's events, in the order it emitted them."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(replica, event)
            elif isinstance(event, BlockRemoved):
                tier = self._tier_id.get(event.tier)
                for h in event.block_hashes if tier is not None else ():
                    rid = self._replica_id.get(replica)
                    if rid is None:  # it holds nothing (any more)
                        break
                    self._drop_holder(rid, h, tier)
            elif isinstance(event, AllCleared):
                self.remove_replica(replica)
            else:
                raise TypeError(f"not a KV event: {event!r}")
        self._bound()

    def remove_replica(self, replica: str) -> None:
        """Forget every block of a replica (it died, was scaled down, or resent a snapshot)."""
        rid = self._replica_id.get(replica)
        if rid is None:
            return
        inline, shared = self._slots_of(rid)
        for s in inline:
            self._holder[s] = _NONE
        for s in shared:
            self._unshare(s, rid)
        self._release(rid)
        for s in inline + shared:
            self._prune(s)

    def blocks_of(self, replica: str) -> list[BlockHash]:
        """Every block the index says `replica` holds (in any tier), in no particular order."""
        rid = self._replica_id.get(replica)
        if rid is None:
            return []
        inline, shared = self._slots_of(rid)
        return [h for h in map(self._hash.__getitem__, inline + shared) if h is not None]

    def _slots_of(self, rid: int) -> tuple[list[int], list[int]]:
        """The slots replica `rid` holds alone, and those it shares. One vectorized pass over the holders (asked
        rarely; a per-replica set would cost ~40 B a block). A slot never used yet holds zeros (`_grow`), so it
        reads as replica 0's: its hash is None."""
        inline = np.flatnonzero(np.frombuffer(self._holder, dtype=np.int32) == rid).tolist()
        return inline, [s for s, holders in self._shared.items() if rid in holders]

    def match(self, block_hashes: list[BlockHash]) -> dict[str, Overlap]:
        """Each replica's count of leading blocks held (contiguously from the first), with their tiers.

        Replicas holding none of the first block are absent. Matched nodes count as recently used.
        """
        get, parent, holder, tier, shared = self._slot.get, self._parent, self._holder, self._tier, self._shared
        path: list[int] = []  # the matched nodes, from the first block
        runs: list[tuple[int, Iterable[int]]] = []  # (blocks, the replicas whose run ended there)
        alive: set[int] | None = None  # replicas holding every block so far
        tiers_seen: set[int] = set()  # one tier (the usual) answers fast: every replica's run in one tuple
        expected = _NONE
        for h in block_hashes:
            s = get(h)
            if s is None or parent[s] != expected:
                break
            path.append(s)
            expected = s
            one = holder[s]
            tiers_seen.add(tier[s])
            if one >= 0:  # one holder: the common case, kept off the set operations
                if alive is None:
                    alive = {one}
                    continue
                if one in alive:
                    if len(alive) > 1:
                        alive.discard(one)
                        runs.append((len(path) - 1, alive))
                        alive = {one}
                    continue
                here = {one}
            else:
                here = shared[s] if one == _SHARED else {}
            if alive is None:
                alive = set(here)
            elif gone := alive.difference(here):
                runs.append((len(path) - 1, gone))
                alive -= gone
            if not alive:
                break
        self._lru.touch_path(path)
        runs.append((len(path), alive or ()))
        names, tier_names, out = self._replica_name, self._tier_name, {}
        if len(tiers_seen) == 1 and _MIXED not in tiers_seen:
            (name,) = (tier_names[t] for t in tiers_seen)
            for n, replicas in runs:
                out.update(zip(map(names.__getitem__, replicas), repeat(Overlap(n, (name,) * n))))
            return out
        for n, replicas in runs:
            for r in replicas:
                ids = (tier[s] if holder[s] >= 0 else shared[s][r] for s in path[:n])
                out[names[r]] = Overlap(n, tuple(tier_names[t] for t in ids))
        return out

    def snapshot(self) -> list[Row]:
        """Every node as (hash, parent hash, holders), parents before children."""
        depth: dict[int, int] = {_NONE: -1}
        for s in self._slot.values():
            path = []
            while s not in depth:
                path.append(s)
                s = self._parent[s]
            for d, t in enumerate(reversed(path), depth[s] + 1):
                depth[t] = d
        slots = sorted(self._slot.values(), key=depth.__getitem__)
        parent_hash = [None if p == _NONE else self._hash[p] for p in (self._parent[s] for s in slots)]
        return [(self._hash[s], parent, self._holders(s)) for s, parent in zip(slots, parent_hash)]

    @classmethod
    def restore(cls, rows: list[Row], max_blocks: int = 1_000_000) -> PrefixIndex:
        index = cls(max_blocks)
        for h, parent, holders in rows:
            s = index._link(h, _NONE if parent is None else index._get_or_new(parent))
            for replica, tier in holders.items():
                index._add_holder(s, index._replica_of(replica), index._tier_of(tier))
        index._bound()
        return index

    # Tree edits.

    def _store(self, replica: str, event: BlockStored) -> None:
        rid, tid = self._replica_of(replica), self._tier_of(event.tier)
        # The parent may be unknown here (evicted from the engine or from this index): keep an
        # unheld node for it so the chain links up again if the parent is stored later.
        p = _NONE if event.parent_block_hash is None else self._get_or_new(event.parent_block_hash)
        get, parent, children, holder, tier = self._slot.get, self._parent, self._children, self._holder, self._tier
        path, added = [], 0
        for h in event.block_hashes:  # `_link(h, p)` and `_add_holder`, inlined: the event stream's hot loop
            s = get(h)
            if s is None:
                s = self._new(h)
            if p != _NONE and parent[s] == _NONE and p != s:
                parent[s] = p
                children[p] += 1
            one = holder[s]
            if one == _NONE:
                holder[s], tier[s] = rid, tid
                added += 1
            elif one == rid:
                tier[s] = tid
            else:
                self._add_holder(s, rid, tid)
            path.append(s)
            p = s
        self._held[rid] += added
        self._lru.touch_path(path)

    def _get_or_new(self, h: BlockHash) -> int:
        s = self._slot.get(h)
        return self._new(h) if s is None else s

    def _link(self, h: BlockHash, p: int) -> int:
        """The node of `h`, recently used, its parent `p` set if it had none."""
        s = self._slot.get(h)
        if s is None:
            s = self._new(h)
        else:
            self._lru.touch(s)
        if p != _NONE and self._parent[s] == _NONE and p != s:
            self._parent[s] = p
            self._children[p] += 1
        return s

    def _new(self, h: BlockHash) -> int:
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._slot[h], self._hash[s] = s, h
        self._parent[s], self._children[s], self._holder[s] = _NONE, 0, _NONE
        self._lru.add(s)
        return s

    def _add_holder(self, s: int, rid: int, tid: int) -> None:
        one = self._holder[s]
        if one == rid:
            self._tier[s] = tid
            return
        if one == _NONE:
            self._holder[s], self._tier[s] = rid, tid
        else:
            if one != _SHARED:
                self._shared[s], self._holder[s] = {one: self._tier[s]}, _SHARED
            if tid != self._tier[s]:
                self._tier[s] = _MIXED  # until it has one holder again
            holders = self._shared[s]
            known = rid in holders
            holders[rid] = tid
            if known:
                return
        self._held[rid] += 1

    def _drop_holder(self, rid: int, h: BlockHash, tid: int) -> None:
        s = self._slot.get(h)
        if s is None:
            return
        one = self._holder[s]
        if one == rid and self._tier[s] == tid:
            self._holder[s] = _NONE
        elif one == _SHARED and self._shared[s].get(rid) == tid:
            self._unshare(s, rid)
        else:
            return
        self._unhold(rid)
        self._prune(s)

    def _unshare(self, s: int, rid: int) -> None:
        holders = self._shared[s]
        del holders[rid]
        if len(holders) == 1:
            ((self._holder[s], self._tier[s]),) = holders.items()
            del self._shared[s]

    def _holders(self, s: int) -> dict[str, str]:
        one = self._holder[s]
        holders = {one: self._tier[s]} if one >= 0 else self._shared.get(s, {})
        return {self._replica_name[r]: self._tier_name[t] for r, t in holders.items()}

    def _prune(self, s: int) -> None:
        """Delete nodes nobody holds and nothing hangs from, walking up the chain."""
        while s != _NONE and self._hash[s] is not None and self._holder[s] == _NONE and not self._children[s]:
            p = self._parent[s]
            self._delete(s)
            s = p

    def _delete(self, s: int) -> None:
        del self._slot[self._hash[s]]
        self._hash[s] = None
        self._lru.remove(s)
        one, self._holder[s] = self._holder[s], _NONE
        if one >= 0:
            self._unhold(one)
        elif one == _SHARED:
            for rid in self._shared.pop(s):
                self._unhold(rid)
        p = self._parent[s]
        if p != _NONE:
            self._children[p] -= 1
            if not self._children[p]:
                self._lru.orphaned(p)
        self._free.append(s)

    def _bound(self) -> None:
        while len(self._slot) > self.max_blocks:
            self._delete(self._lru.oldest_leaf())

    def _grow(self) -> None:
        n = len(self._hash)
        room = self.max_blocks + 1 - n  # slots up to the bound; past it (a batch overshooting), grow in steps
        extra = min(max(64, n // 2), room) if room > 0 else max(64, n // 8)
        for column in (self._parent, self._children, self._holder, self._tier):
            column.frombytes(bytes(extra * column.itemsize))
        self._lru.grow(extra)
        self._hash.extend([None] * extra)
        self._free.extend(range(n + extra - 1, n - 1, -1))

    # Replica and tier tables.

    def _replica_of(self, name: str) -> int:
        rid = self._replica_id.get(name)
        if rid is None:
            rid = self._free_replicas.pop() if self._free_replicas else len(self._replica_name)
            if rid == len(self._replica_name):
                self._replica_name.append(name)
                self._held.append(0)
            self._replica_id[name], self._replica_name[rid] = rid, name
        return rid

    def _unhold(self, rid: int) -> None:
        self._held[rid] -= 1
        if not self._held[rid]:
            self._release(rid)

    def _release(self, rid: int) -> None:
        del self._replica_id[self._replica_name[rid]]
        self._replica_name[rid], self._held[rid] = None, 0
        self._free_replicas.append(rid)

    def _tier_of(self, tier: str) -> int:
        tid = self._tier_id.get(tier)
        if tid is None:
            if len(self._tier_name) == _MIXED:
                raise ValueError(f"more than {_MIXED} distinct tiers in KV events (new: {tier!r})")
            tid = self._tier_id[tier] = len(self._tier_name)
            self._tier_name.append(tier)
        return tid
