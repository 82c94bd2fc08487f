"""Part 1 of `bench/router_scale.py`: rayapp's PrefixIndex alone (this process, no Ray), filled and then stored into
full, against Ray Serve LLM's `PrefixTree` fed the same workload as text.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

import psutil
from router_scale_workload import (
    CONVERSATION,
    PAGE,
    SYSTEM,
    SYSTEM_BLOCKS,
    TURN_BLOCKS,
    TURNS,
    block_hash,
    prompt,
    turn,
)

from rayapp.blocks import BlockStored
from rayapp.prefix_router.index import PrefixIndex


def timed_turns(index: PrefixIndex, conversations: range) -> float:
    """Store `conversations` turn by turn (so a conversation's history is older than its tail), as 64
    replicas would; returns the seconds `apply` took (events are made outside the clock, 4K at a time)."""
    elapsed = 0.0
    for t in range(TURNS):
        for first in range(conversations.start, conversations.stop, 4096):
            events = [(f"r{c % 64}", [turn(c, t)]) for c in range(first, min(first + 4096, conversations.stop))]
            start = time.perf_counter()
            for replica, batch in events:
                index.apply(replica, batch)
            elapsed += time.perf_counter() - start
    return elapsed


def measure_index(blocks: int, memory: str) -> dict[str, float]:
    """A PrefixIndex bounded at `blocks`: filled, then as many blocks again stored into it full (each store
    evicting); matches of recent conversations' prompts. Memory by tracemalloc (a separate fill: tracing
    slows it) or by this process's RSS growth."""
    conversations = blocks // CONVERSATION
    used = 0.0
    if memory == "tracemalloc":
        gc.collect()
        tracemalloc.start()
        traced = PrefixIndex(blocks)
        timed_turns(traced, range(conversations))
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del traced
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    index = PrefixIndex(blocks)
    for r in range(64):  # every replica holds the system prompt
        index.apply(f"r{r}", [BlockStored(SYSTEM, None, (), PAGE)])
    fill_s = timed_turns(index, range(conversations))
    if memory == "rss":
        used = psutil.Process().memory_info().rss - rss0
    full_s = timed_turns(index, range(conversations, 2 * conversations))
    recent = random.Random(0).choices(range(2 * conversations - conversations // 10, 2 * conversations), k=2000)
    queries = [prompt(c) for c in recent]
    start = time.perf_counter()
    for q in queries:
        index.match(q)
    match_us = (time.perf_counter() - start) / len(queries) * 1e6
    stored = conversations * CONVERSATION
    return {
        "blocks": len(index), "bytes_per_block": used / stored, "fill_blocks_s": stored / fill_s,
        "full_blocks_s": stored / full_s, "visits_per_block": index.eviction_visits / stored, "match_us": match_us,
    }  # fmt: skip


def measure_prefix_tree(blocks: int) -> dict[str, float]:
    """Ray Serve LLM's PrefixTree on the same workload: each turn's whole prompt inserted as text."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    def text(conversation: int, count: int) -> str:  # 16 characters a block, from its hash
        hashes = (block_hash(conversation, i) for i in range(count))
        return "".join(chr(0x4E00 + ((h >> (4 * j)) & 0xFFF)) for h in hashes for j in range(PAGE))

    system, conversations, tenants = text(-1, SYSTEM_BLOCKS), blocks // CONVERSATION, [f"r{i}" for i in range(64)]
    texts = [text(c, CONVERSATION + 8) for c in range(conversations)]

    def fill(trace: bool) -> tuple[PrefixTree, float, float]:
        tree, elapsed = PrefixTree(), 0.0
        tree.add_tenants(tenants, time.time())
        gc.collect()
        if trace:
            tracemalloc.start()
        for t in range(TURNS):
            for c in range(conversations):
                whole, now = system + texts[c][: (t + 1) * TURN_BLOCKS * PAGE], time.time()
                start = time.perf_counter()
                tree.insert(whole, tenants[c % 64], now)
                elapsed += time.perf_counter() - start
        used = tracemalloc.get_traced_memory()[0] if trace else 0.0
        tracemalloc.stop()
        return tree, elapsed, used

    used = fill(trace=True)[2]
    tree, elapsed, _ = fill(trace=False)
    queries = [system + texts[c] for c in random.Random(0).choices(range(conversations), k=2000)]
    start = time.perf_counter()
    for q in queries:
        tree.prefix_match(q, tenants)
    match_us = (time.perf_counter() - start) / len(queries) * 1e6
    stored = conversations * CONVERSATION
    return {"bytes_per_block": used / stored, "fill_blocks_s": stored / elapsed, "match_us": match_us}


def index_alone(args: argparse.Namespace) -> None:
    memory = "rss" if args.rss else "tracemalloc"
    print(f"== 1. index alone (this process; memory by {memory})")
    ours, theirs = measure_index(args.baseline_blocks, "tracemalloc"), measure_prefix_tree(args.baseline_blocks)
    row = "  {:<22}{:>12.0f}{:>15,.0f}{:>11.1f}"
    print(f"at {args.baseline_blocks:,} blocks       bytes/block  fill blocks/s  match us")
    for name, m in (("rayapp PrefixIndex", ours), ("Ray LLM PrefixTree", theirs)):
        print(row.format(name, m["bytes_per_block"], m["fill_blocks_s"], m["match_us"]))
    ratio = {k: ours[k] / theirs[k] for k in ("bytes_per_block", "fill_blocks_s", "match_us")}
    print("  {:<22}{:>11.2f}x{:>14.1f}x{:>10.2f}x".format("ratio rayapp / Ray", *ratio.values()))
    big = measure_index(args.index_blocks, memory)
    print(
        f"rayapp PrefixIndex at {big['blocks']:,} blocks: {big['bytes_per_block']:.0f} B/block, "
        f"fill {big['fill_blocks_s']:,.0f} blocks/s, into the full index (each store evicting) "
        f"{big['full_blocks_s']:,.0f} blocks/s with {big['visits_per_block']:.2f} nodes visited by eviction a "
        f"stored block, match of a 64-block prompt {big['match_us']:.1f} us"
    )
