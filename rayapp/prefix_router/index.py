"""`PrefixIndex`: which replica holds which prefix blocks, in which tier, fed by KV events.

A radix tree over block-hash chains. A block hash already names its whole prefix (it chains on
its parent's), so the tree is a dict from hash to node plus parent/child links; a request's
hash chain walks it from the root in O(prefix blocks). Each node records the replicas holding
that block and the tier each holds it in. The index only learns from the engines' own events
(`BlockStored` / `BlockRemoved` / `AllCleared`), so it never guesses from text.

Memory is bounded: past `max_blocks` nodes, the least recently stored-or-matched leaves are
dropped (a leaf first, so a kept node's parent is always kept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False)
class _Node:
    block_hash: BlockHash
    parent: _Node | None
    children: dict[BlockHash, _Node] = field(default_factory=dict)
    # replica -> tier ("device", "host", ...) the replica holds this block in.
    holders: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Overlap:
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
        self._nodes: dict[BlockHash, _Node] = {}
        # Every node, least recently stored or matched first.
        self._recency: OrderedDict[BlockHash, None] = OrderedDict()
        self._by_replica: dict[str, set[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def replicas(self) -> set[str]:
        return {r for r, held in self._by_replica.items() if held}

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        """Apply one replica's events, in the order it emitted them."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(replica, event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._drop_holder(replica, h, event.tier)
            elif isinstance(event, AllCleared):
                self.remove_replica(replica)
            else:
                raise TypeError(f"not a KV event: {event!r}")
        self._bound()

    def remove_replica(self, replica: str) -> None:
        """Forget every block of a replica (it died, was scaled down, or resent a snapshot)."""
        for h in list(self._by_replica.pop(replica, ())):
            node = self._nodes.get(h)
            if node is not None:
                node.holders.pop(replica, None)
                self._prune(node)

    def match(self, block_hashes: list[BlockHash]) -> dict[str, Overlap]:
        """Each replica's count of leading blocks held (contiguously from the first), with their tiers.

        Replicas holding none of the first block are absent. Matched nodes count as recently used.
        """
        result: dict[str, Overlap] = {}
        alive: dict[str, list[str]] = {}
        for depth, h in enumerate(block_hashes):
            node = self._nodes.get(h)
            expected_parent = block_hashes[depth - 1] if depth else None
            if node is None or (node.parent.block_hash if node.parent else None) != expected_parent:
                break
            self._recency.move_to_end(h)
            if depth == 0:
                alive = {r: [t] for r, t in node.holders.items()}
            else:
                for r in [r for r in alive if r not in node.holders]:
                    result[r] = Overlap(depth, tuple(alive.pop(r)))
                for r in alive:
                    alive[r].append(node.holders[r])
            if not alive:
                break
        for r, tiers in alive.items():
            result[r] = Overlap(len(tiers), tuple(tiers))
        return result

    def snapshot(self) -> list[tuple[BlockHash, BlockHash | None, dict[str, str]]]:
        """Every node as (hash, parent hash, holders), parents before children."""
        out = []
        stack = [n for n in self._nodes.values() if n.parent is None]
        while stack:
            node = stack.pop()
            out.append((node.block_hash, node.parent.block_hash if node.parent else None, dict(node.holders)))
            stack.extend(node.children.values())
        return out

    @classmethod
    def restore(
        cls, rows: list[tuple[BlockHash, BlockHash | None, dict[str, str]]], max_blocks: int = 1_000_000
    ) -> PrefixIndex:
        index = cls(max_blocks)
        for h, parent, holders in rows:
            node = index._node(h, parent)
            for replica, tier in holders.items():
                node.holders[replica] = tier
                index._by_replica.setdefault(replica, set()).add(h)
        index._bound()
        return index

    def _store(self, replica: str, event: BlockStored) -> None:
        parent = event.parent_block_hash
        if parent is not None:
            # The parent may be unknown here (evicted from the engine or from this index): keep
            # an unheld node for it so the chain links up again if the parent is stored later.
            self._node(parent, None)
        held = self._by_replica.setdefault(replica, set())
        for h in event.block_hashes:
            node = self._node(h, parent)
            node.holders[replica] = event.tier
            held.add(h)
            self._recency.move_to_end(h)
            parent = h

    def _node(self, h: BlockHash, parent: BlockHash | None) -> _Node:
        node = self._nodes.get(h)
        if node is None:
            node = self._nodes[h] = _Node(h, None)
            self._recency[h] = None
        if node.parent is None and parent is not None:
            node.parent = self._nodes[parent]
            node.parent.children[h] = node
        return node

    def _drop_holder(self, replica: str, h: BlockHash, tier: str) -> None:
        node = self._nodes.get(h)
        if node is None or node.holders.get(replica) != tier:
            return
        del node.holders[replica]
        self._by_replica[replica].discard(h)
        self._prune(node)

    def _prune(self, node: _Node | None) -> None:
        """Delete nodes nobody holds and nothing hangs from, walking up the chain."""
        while node is not None and not node.holders and not node.children:
            self._delete(node)
            node = node.parent

    def _delete(self, node: _Node) -> None:
        del self._nodes[node.block_hash]
        del self._recency[node.block_hash]
        if node.parent is not None:
            del node.parent.children[node.block_hash]
        for replica in node.holders:
            self._by_replica[replica].discard(node.block_hash)

    def _bound(self) -> None:
        if len(self._nodes) <= self.max_blocks:
            return
        while len(self._nodes) > self.max_blocks:
            for h in list(self._recency):
                node = self._nodes.get(h)
                if node is not None and not node.children:
                    self._delete(node)
                    if len(self._nodes) <= self.max_blocks:
                        return
