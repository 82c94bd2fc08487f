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
import os

import ray
from router_scale_fleet import ceiling, fleet, summary
from router_scale_index import index_alone


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
