"""Part 2 of `bench/router_scale.py`: the fleet on a local Ray. Simulated replicas publish their KV events to the
real PrefixIndex actor while another process times routing decisions against it; and the actor's ceiling alone.
Ray's workers import this module's actors by name: Ray puts the driver script's folder (bench/) on their path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from collections import OrderedDict

import numpy as np
import psutil
import ray
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

from rayapp.blocks import AllCleared, BlockRemoved, BlockStored
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import prefix_index, shard_of
from rayapp.prefix_router.publisher import KVEventPublisher


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def join_time(replica: int, replicas: int, start: float, ramp_s: float) -> float:
    """When a replica joins (sends its snapshot and starts storing): spread evenly over the ramp."""
    return start + ramp_s * replica / replicas


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


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
