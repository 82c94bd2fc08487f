"""The PrefixIndex at fleet scale: KV event streams of hundreds of GPU replicas against the real actor.

The workload, everywhere below: every conversation opens with one 8-block system prompt (16-token
pages) and grows by turns of 8 blocks, 6 turns (48 blocks of its own); a replica stores each turn
as one `BlockStored` chained on the last (with its 128 token ids, as rayapp's events carry them).

1. Index alone (this process, no Ray), at `--index-blocks` (default 1M): fill a `PrefixIndex` bounded
   at that size, then keep storing (each store evicting); print bytes a block (tracemalloc; RSS growth
   with `--rss`), blocks/s stored into the full index, eviction's nodes visited a block, and µs per
   match of a 64-block prompt (the system prompt, a conversation, 8 unseen blocks). Baseline, same run
   and same workload at `--baseline-blocks` (default 100K, where both are also measured): Ray Serve
   LLM's `PrefixTree`, the text radix tree of its `PrefixCacheAffinityRouter`, fed each turn's whole
   prompt as text (16 characters a block) as that router inserts prompts. It has no event stream or
   bound of its own (its router evicts per tenant on a timer), so only its insert, match and memory
   compare, as ratios.
2. Fleet (a local Ray on this machine). First the actor's ceiling: one replica-period of events a
   call (its turns stored and as many blocks removed, made beforehand), sent as fast as it
   acknowledges them, so how many GPU replicas one actor absorbs at `--period` (Ray's own cost per
   call, ~0.3 ms of actor CPU here, bounds it at short periods). Then, for each `--replicas` (default
   256 and 1,000): simulated replicas in `--fleet-procs` processes, each a real `KVEventPublisher`
   (numbered batches every `--period` s, at most 512 events a batch) over a simulated engine storing
   `--tokens-per-s` (5K: 312 blocks/s) and evicting its oldest conversations once it holds its share
   of `--fleet-blocks` (default 1M, the index bounded at the same size). Replicas join with warm
   caches (their snapshot first), spread over the ramp (a second per 100K blocks); then `--duration`
   s are measured. Meanwhile another process times routing decisions (`match` over every replica's
   name, as the router sends them, `--decisions` a second) against the same actor. Printed: block
   events/s offered and absorbed (stored + removed, snapshots apart), index lag (a batch's
   acknowledgement minus its oldest event's time: includes up to one period of waiting in the
   replica), its growth over the run (last third's median over the first's), decision latency
   p50/p99 (with the idle actor's, measured first, as the floor), the actor's CPU share and RSS.
   There is no prior anchor for a KV-event index of this scale in Ray Serve LLM: the fleet figures
   are absolute, printed against the targets (all offered events absorbed, decision p99 <= 5 ms,
   lag growth <= 1.5x). `--shards S` splits the index by replica over S actors (`index_shards`): this
   machine (2 cores here, shared with the simulators) then runs shard 0 under its share of the fleet, the
   replicas that hash to it, as each shard on a core of its own would run.

    python bench/router_scale.py                                  # index at 1M + fleets of 256 and 1,000
    python bench/router_scale.py --index-blocks 10000000 --rss --skip-fleet
    python bench/router_scale.py --skip-index --replicas --period 1.0        # the actor's ceiling only
    python bench/router_scale.py --skip-index --replicas 1000 --shards 12    # one shard of a 1,000-replica fleet
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import time
import tracemalloc
from collections import OrderedDict

import numpy as np
import psutil
import ray

from rayapp.blocks import AllCleared, BlockRemoved, BlockStored
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import prefix_index, shard_of
from rayapp.prefix_router.index import PrefixIndex
from rayapp.prefix_router.publisher import KVEventPublisher

PAGE, SYSTEM_BLOCKS, TURN_BLOCKS, TURNS = 16, 8, 8, 6
CONVERSATION = TURN_BLOCKS * TURNS
MASK = (1 << 64) - 1


def block_hash(conversation: int, i: int) -> int:
    """Block `i` of a conversation's own chain: a fixed pseudo-random 64-bit hash (a splitmix64 step)."""
    x = ((conversation << 16 | i) + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    return x ^ (x >> 31)


SYSTEM = tuple(block_hash(-1, i) for i in range(SYSTEM_BLOCKS))


def turn(conversation: int, t: int) -> BlockStored:
    first = t * TURN_BLOCKS
    hashes = tuple(block_hash(conversation, i) for i in range(first, first + TURN_BLOCKS))
    parent = block_hash(conversation, first - 1) if t else SYSTEM[-1]
    return BlockStored(hashes, parent, tuple(range(first * PAGE, (first + TURN_BLOCKS) * PAGE)), PAGE)


def prompt(conversation: int) -> list[int]:
    """A 64-block prompt: the system prompt, the whole conversation, 8 blocks nobody holds."""
    return [*SYSTEM, *(block_hash(conversation, i) for i in range(CONVERSATION + 8))]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def join_time(replica: int, replicas: int, start: float, ramp_s: float) -> float:
    """When a replica joins (sends its snapshot and starts storing): spread evenly over the ramp."""
    return start + ramp_s * replica / replicas


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


# 1. The index alone, against Ray Serve LLM's PrefixTree.


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


# 2. The fleet.


class SimEngine:
    """A replica's prefix cache as its KV events show it: turns stored at a GPU's rate, oldest conversations evicted.

    It keeps only how many turns of each conversation it holds; events are made when sent."""

    def __init__(self, replica: int, capacity: int, blocks_per_s: float, start: float) -> None:
        self.name, self.capacity, self.rate = f"replica-{replica:04d}", capacity, blocks_per_s
        self.base = replica << 24  # conversation ids: this replica's, in order
        warm = capacity // CONVERSATION  # it joins warm: its snapshot carries these
        self.cached = OrderedDict((c, TURNS) for c in range(self.base - warm, self.base))  # conversation -> turns
        self.held, self.turns, self.due, self.last = warm * CONVERSATION, 0, 0.0, start
        self.pending: list = []
        self.window_start = start  # when the oldest event not yet taken happened
        self.in_snapshot = False  # the batches being sent are a snapshot's

    def _advance(self, now: float) -> None:
        self.due += self.rate * (now - self.last)
        self.last = now
        while self.due >= TURN_BLOCKS:
            self.due -= TURN_BLOCKS
            c, t = divmod(self.turns, TURNS)
            self.turns += 1
            self.pending.append(turn(self.base + c, t))
            self.cached[self.base + c] = t + 1
            self.cached.move_to_end(self.base + c)
            self.held += TURN_BLOCKS
            while self.held > self.capacity:
                gone, turns = self.cached.popitem(last=False)
                blocks = turns * TURN_BLOCKS  # tail first, as vLLM frees them
                self.pending.append(BlockRemoved(tuple(block_hash(gone, i) for i in reversed(range(blocks)))))
                self.held -= blocks

    async def take_events(self) -> list:
        now = time.monotonic()
        self._advance(now)
        events, self.pending, self.window_start, self.in_snapshot = self.pending, [], now, False
        return events

    async def snapshot(self) -> list:
        now = time.monotonic()
        self._advance(now)
        self.pending, self.window_start, self.in_snapshot = [], now, True
        system = BlockStored(SYSTEM, None, tuple(range(SYSTEM_BLOCKS * PAGE)), PAGE)
        return [AllCleared(), system, *(turn(c, t) for c, turns in self.cached.items() for t in range(turns))]


class TimedIndex:
    """The actor handle as the publisher sees it; logs each batch's acknowledgement, lag and size."""

    def __init__(self, handle, engine: SimEngine, log: list) -> None:
        self.handle, self.engine, self.log = handle, engine, log
        self.publish = self

    def remote(self, replica: str, batch: int, events: list):
        oldest, ref = self.engine.window_start, self.handle.publish.remote(replica, batch, events)
        blocks = sum(len(e.block_hashes) for e in events if not isinstance(e, AllCleared))
        snapshot = self.engine.in_snapshot

        async def acked():
            applied = await ref
            now = time.monotonic()
            self.log.append((now, now - oldest, blocks, snapshot, applied))
            return applied

        return acked()


@ray.remote(num_cpus=0)
class Fleet:
    async def run(self, replicas: list[int], capacity: int, args: dict, start: float, ramp_s: float) -> list:
        handle = args["index"]
        log: list = []

        async def replica(r: int) -> None:
            joined = join_time(r, args["replicas"], start, ramp_s)
            await asyncio.sleep(max(0.0, joined - time.monotonic()))
            engine = SimEngine(r, capacity, args["tokens_per_s"] / PAGE, joined)
            timed = TimedIndex(handle, engine, log)
            publisher = KVEventPublisher(
                engine.name, lambda: timed, engine.take_events, engine.snapshot, args["period"], 512
            )
            await publisher.run()

        tasks = [asyncio.create_task(replica(r)) for r in replicas]
        await asyncio.sleep(max(0.0, start + ramp_s + args["settle"] + args["duration"] - time.monotonic()))
        for task in tasks:  # not awaited: a publisher stuck behind an overloaded actor must not hold the answer
            task.cancel()
        return log


@ray.remote(num_cpus=0)
class Decisions:
    async def run(self, args: dict, start: float, ramp_s: float, begin: float, until: float):
        """Seconds per `match` of a replica's recent conversation, over every name of the shard's replicas (those
        the shard answers for in a routing decision), at a steady rate."""
        replicas, members, rate = args["replicas"], args["members"], args["decisions"]
        handle, names = args["index"], [f"replica-{r:04d}" for r in members]
        rng, out, turns_per_s = random.Random(1), [], args["tokens_per_s"] / PAGE / TURN_BLOCKS
        await asyncio.sleep(max(0.0, begin - time.monotonic()))
        while time.monotonic() < until:
            r = rng.choice(members)
            now = int((time.monotonic() - join_time(r, replicas, start, ramp_s)) * turns_per_s) // TURNS
            query = prompt((r << 24) + now - rng.randint(0, 3))  # its current or a recent conversation
            begin = time.perf_counter()
            # An answer later than 1 s counts as 1 s (the router gives up after `index_timeout_s` anyway).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(handle.match.remote(query, names), 1.0)
            out.append(time.perf_counter() - begin)
            await asyncio.sleep(1 / rate)
        return out


def ceiling(args: argparse.Namespace) -> None:
    """The actor alone, fed as fast as it acknowledges: one replica-period of events a call (its stored turns
    and as many removed blocks), made beforehand; so how many GPU replicas one actor absorbs at this period."""
    index = prefix_index("ceiling", RouterConfig(index_max_blocks=args.fleet_blocks, replica_timeout_s=600.0))
    proc = psutil.Process(ray.get(index.__ray_call__.remote(lambda _: os.getpid())))
    turns = max(1, round(args.tokens_per_s / PAGE * args.period / TURN_BLOCKS))  # a replica's turns a period
    calls = max(64, min(2000, int(200_000 / (turns * TURN_BLOCKS))))
    batches = []
    for i in range(calls):
        r, k = i % 64, i // 64
        stored = [turn((r << 24) + (k * turns + j) // TURNS, (k * turns + j) % TURNS) for j in range(turns)]
        removed = BlockRemoved(tuple(block_hash((r << 24) - 1 - k, i) for i in range(turns * TURN_BLOCKS)))
        batches.append((f"c{r}", k + 1, [*stored, removed]))
    ray.get([index.publish.remote(f"c{r}", 0, [AllCleared()]) for r in range(64)])
    cpu0, start = cpu_seconds([proc]), time.perf_counter()
    assert all(ray.get([index.publish.remote(*batch) for batch in batches]))
    elapsed = time.perf_counter() - start
    cpu = (cpu_seconds([proc]) - cpu0) / elapsed
    blocks_s = calls * 2 * turns * TURN_BLOCKS / elapsed
    per_replica = 2 * args.tokens_per_s / PAGE
    print(
        f"one actor, {turns * TURN_BLOCKS} stored + {turns * TURN_BLOCKS} removed blocks a call: {calls / elapsed:,.0f}"
        f" calls/s, {blocks_s:,.0f} block events/s (actor CPU {cpu:.0%}): absorbs"
        f" {min(blocks_s / per_replica, calls / elapsed * args.period):,.0f} GPU replicas at a {args.period} s period",
        flush=True,
    )
    ray.kill(index)


def fleet(replicas: int, args: argparse.Namespace, results: list[dict]) -> None:
    name = f"scale-{replicas}"
    config = RouterConfig(index_max_blocks=args.fleet_blocks, replica_timeout_s=60.0, index_shards=args.shards)
    # With shards, this machine runs shard 0 under its share of the fleet (the replicas that hash to it); the
    # others, each on a core of its own, see the same load, and a decision waits for the slowest of them.
    members = [r for r in range(replicas) if shard_of(f"replica-{r:04d}", args.shards) == 0]
    index = prefix_index(name, config, 0)
    proc = psutil.Process(ray.get(index.__ray_call__.remote(lambda _: os.getpid())))
    capacity = args.fleet_blocks // replicas
    ramp_s = max(5.0, args.fleet_blocks / 100_000)  # the joining replicas' snapshots, spread
    keys = ("tokens_per_s", "period", "duration", "settle", "decisions")
    shared = {"index": index, "replicas": replicas, "members": members, **{k: getattr(args, k) for k in keys}}
    now = time.monotonic()
    idle = ray.get(Decisions.remote().run.remote(shared, now, 0.0, now, now + 5))
    rss0 = proc.memory_info().rss
    start = time.monotonic() + 2.0
    measure_from = start + ramp_s + args.settle
    until = measure_from + args.duration
    procs = [Fleet.remote() for _ in range(args.fleet_procs)]
    fleet_procs = [psutil.Process(ray.get(f.__ray_call__.remote(lambda _: os.getpid()))) for f in procs]
    runs = [f.run.remote(members[i :: args.fleet_procs], capacity, shared, start, ramp_s) for i, f in enumerate(procs)]
    decisions = Decisions.remote().run.remote(shared, start, ramp_s, measure_from, until)
    share = f" over {args.shards} shards, shard 0's {len(members)} run here" if args.shards > 1 else ""
    print(f"  {replicas} replicas{share} joining over {ramp_s:.0f} s, measuring {args.duration:.0f} s", flush=True)
    time.sleep(max(0.0, measure_from - time.monotonic()))
    cpu0, fleet_cpu0, wall0 = cpu_seconds([proc]), cpu_seconds(fleet_procs), time.monotonic()
    time.sleep(max(0.0, until - time.monotonic()))
    wall = time.monotonic() - wall0
    cpu, fleet_cpu = (cpu_seconds([proc]) - cpu0) / wall, (cpu_seconds(fleet_procs) - fleet_cpu0) / wall
    rss = proc.memory_info().rss
    try:  # behind a backlog, the actor may not answer soon
        blocks = ray.get(index.stats.remote(), timeout=20)["blocks"]
    except ray.exceptions.GetTimeoutError:
        blocks = 0
    log = [entry for run in ray.get(runs, timeout=120) for entry in run]
    latencies = np.array(ray.get(decisions, timeout=30)) * 1e3
    ray.kill(index)
    for f in procs:
        ray.kill(f)

    steady = [e for e in log if measure_from <= e[0] < until]
    events = [e for e in steady if not e[3]]  # (acknowledged at, lag, blocks, snapshot?, applied?)
    warm_done = max((e[0] for e in log if e[3]), default=float("nan")) - start
    absorbed = sum(e[2] for e in events) / args.duration
    offered = 2 * len(members) * args.tokens_per_s / PAGE  # stored, and as many removed once caches are full
    lags = np.array([e[1] for e in events]) * 1e3
    third = len(events) // 3
    growth = pct(lags[-third:], 50) / pct(lags[:third], 50) if third else float("nan")
    resyncs = sum(1 for e in steady if e[3])  # snapshot batches acknowledged in the window
    results.append({
        "replicas": replicas, "shards": args.shards, "members": len(members), "blocks": args.fleet_blocks,
        "period": args.period, "absorbed": absorbed,
        "offered": offered, "lag_p50": pct(lags, 50), "lag_p99": pct(lags, 99), "growth": growth,
        "p50": pct(latencies, 50), "p99": pct(latencies, 99), "idle_p50": pct(idle, 50) * 1e3,
        "idle_p99": pct(idle, 99) * 1e3, "late": float(np.mean(latencies > 50)), "cpu": cpu, "fleet_cpu": fleet_cpu,
        "rss_mib": (rss - rss0) / 2**20, "held": blocks, "warm_s": warm_done, "resyncs": resyncs,
    })  # fmt: skip
    r = results[-1]
    print(
        f"  absorbed {r['absorbed']:,.0f} of {offered:,.0f} block events/s offered ({r['absorbed'] / offered:.0%});"
        f" lag p50 {r['lag_p50']:.0f} ms p99 {r['lag_p99']:.0f} ms (growth {r['growth']:.2f}x); decisions p50"
        f" {r['p50']:.2f} ms p99 {r['p99']:.2f} ms (idle actor {r['idle_p50']:.2f} / {r['idle_p99']:.2f} ms), over"
        f" 50 ms {r['late']:.1%}; actor CPU {cpu:.0%}, fleet processes {fleet_cpu:.0%}; actor RSS"
        f" +{r['rss_mib']:,.0f} MiB for {blocks:,} blocks; snapshot batches in the window {resyncs}"
        f" (last at {warm_done:.0f} s)",
        flush=True,
    )


def summary(results: list[dict]) -> None:
    print("\nreplicas  shards (here)  blocks      period  absorbed/offered     lag p50/p99 ms  growth"
          "  decision p50/p99 ms  actor CPU  RSS MiB   targets met")  # fmt: skip
    for r in results:
        met = r["absorbed"] >= 0.95 * r["offered"] and r["p99"] <= 5 and r["growth"] <= 1.5
        print(
            f"{r['replicas']:>8}  {r['shards']:>6} ({r['members']:>4})  {r['blocks']:>10,}  {r['period']:>5}"
            f"  {r['absorbed'] / r['offered']:>8.0%}"
            f" of {r['offered'] / 1e3:>5.0f}K  {r['lag_p50']:>6.0f} / {r['lag_p99']:>6.0f}  {r['growth']:>6.2f}"
            f"  {r['p50']:>7.2f} / {r['p99']:>7.2f}  {r['cpu']:>9.0%}  {r['rss_mib']:>7,.0f}   {'yes' if met else 'no'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index-blocks", type=int, default=1_000_000)
    ap.add_argument("--baseline-blocks", type=int, default=100_000)
    ap.add_argument("--rss", action="store_true", help="measure the index's memory by RSS growth (fast at 10M)")
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--skip-fleet", action="store_true")
    ap.add_argument("--replicas", type=int, nargs="*", default=[256, 1000], help="none: the ceiling only")
    ap.add_argument("--fleet-blocks", type=int, default=1_000_000, help="the index's bound; the caches hold as many")
    ap.add_argument("--fleet-procs", type=int, default=2)
    ap.add_argument("--tokens-per-s", type=float, default=5000.0, help="each replica's rate of KV written")
    ap.add_argument("--period", type=float, default=0.05, help="a replica's event batch period (event_batch_period_s)")
    ap.add_argument("--decisions", type=float, default=100.0, help="routing decisions a second")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after the ramp before measuring")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds measured")
    ap.add_argument(
        "--shards", type=int, default=1, help="the index's shards (index_shards); shard 0 runs its share here"
    )
    args = ap.parse_args()
    if not args.skip_index:
        index_alone(args)
    if not args.skip_fleet:
        print(f"== 2. fleet (period {args.period} s, {args.tokens_per_s:.0f} tokens/s a replica, {os.cpu_count()} CPU)")
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
        results: list[dict] = []
        try:
            ceiling(args)
            for replicas in args.replicas:
                fleet(replicas, args, results)
        finally:
            ray.shutdown()
        if results:
            summary(results)


if __name__ == "__main__":
    main()
