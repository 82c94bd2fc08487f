"""Cluster KV tier, write-through as a serving engine drives it: CPU seconds per process, per run vs batched.

A served engine hands the tier a run of blocks whenever pages fill: the new turn's blocks once per
prefill, then one block per sequence every `block_size` decode steps. This replays that pattern for
`--conversations` conversations of `--turns` turns (each turn `--turn-tokens` new prompt tokens, then
`--answer-tokens` decoded at one token per `--step-ms`), SmolLM2-135M-shaped blocks (30 layers, 3 KV
heads x 64 dims, bf16, 16 tokens), through a real `KVTierClient`, the node's `KVTierStore` actor and an
embedded PostgreSQL catalog. Twice, same run, on distinct tenants so neither pass finds the other's
blocks:

  per run:  the writer writes each run on its own (`max_batch_bytes=1`: one catalog query and one
            `put_many` per run, as the writer did before batching);
  batched:  the shipped writer (runs queued within `COALESCE_S` of the first written together).

Printed: the CPU seconds each process spent (this process stands for the engine's: the writer thread
and Ray's threads; the store actor; the raylet; the PostgreSQL servers), per written block, and the
ratio. Runs a local Ray and an embedded PostgreSQL in a temp dir, both stopped at the end.

    python bench/kvtier_writes.py [--conversations 8] [--turns 6] [--step-ms 40]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import psutil
import ray
import torch

from rayapp.blocks import BlockStored, Tier, hash_blocks
from rayapp.config import KVTierConfig
from rayapp.kvtier import client as tier_client
from rayapp.kvtier.client import KVTierClient
from rayapp.kvtier.embedded import stop_embedded_database

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 30, 16, 3, 64
MODEL = "smollm2-135m"


def processes(store: ray.actor.ActorHandle) -> dict[str, list[psutil.Process]]:
    """The processes whose CPU the writes cost, by role."""
    store_pid = ray.get(store.__ray_call__.remote(lambda _: os.getpid()))
    by_name: dict[str, list[psutil.Process]] = {"raylet": [], "postgres": []}
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in by_name:
            by_name[proc.info["name"]].append(proc)
    return {"engine (this process)": [psutil.Process()], "store actor": [psutil.Process(store_pid)], **by_name}


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    out = {}
    for role, members in procs.items():
        total = 0.0
        for proc in members:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:  # a PostgreSQL backend that ended meanwhile
                continue
            total += times.user + times.system
        out[role] = total
    return out


def replay(client: KVTierClient, tenant: str, args: argparse.Namespace) -> int:
    """Write the serving pattern through `client`; returns the blocks handed to it."""
    page = torch.randn(LAYERS, 1, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    gen = torch.Generator().manual_seed(0)
    conversations: list[list[int]] = [[] for _ in range(args.conversations)]
    written = [0] * args.conversations  # blocks of each conversation handed to the tier
    handed = 0

    def write_full_blocks(c: int) -> None:
        nonlocal handed
        tokens = conversations[c]
        full = len(tokens) // BLOCK
        if full == written[c]:
            return
        hashes = hash_blocks(tokens, BLOCK, (MODEL, tenant))
        start, n = written[c], full - written[c]
        stored = BlockStored(
            tuple(hashes[start:full]), hashes[start - 1] if start else None,
            tuple(tokens[start * BLOCK : full * BLOCK]), BLOCK, Tier.DEVICE,
        )  # fmt: skip
        key = page.expand(-1, n, -1, -1, -1).clone()  # the engine's gather: a copy the tier owns
        client.write(stored, tenant, key, key.clone())
        written[c], handed = full, handed + n

    for _ in range(args.turns):
        for c in range(args.conversations):  # the turn's prefill
            conversations[c] += torch.randint(1, 49152, (args.turn_tokens,), generator=gen).tolist()
            write_full_blocks(c)
            time.sleep(args.step_ms / 1000)
        for _ in range(args.answer_tokens):  # decode: every conversation one token per step
            for c in range(args.conversations):
                conversations[c].append(int(torch.randint(1, 49152, (1,), generator=gen)))
                write_full_blocks(c)
            time.sleep(args.step_ms / 1000)
    return handed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=150, help="new prompt tokens per turn")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=40.0, help="one decode step's time")
    args = ap.parse_args()

    ray.init(address="local", num_cpus=2, object_store_memory=1 << 30, include_dashboard=False)
    data_dir = tempfile.mkdtemp(prefix="rayapp-kvtier-writes-")
    config = KVTierConfig(data_dir=f"{data_dir}/db", capacity_bytes=1 << 30)
    modes = {
        "per run": {"coalesce_s": 0.0, "max_batch_bytes": 1},
        "batched": {"coalesce_s": tier_client.COALESCE_S, "max_batch_bytes": tier_client.MAX_BATCH_BYTES},
    }
    results = {}
    try:
        for mode, options in modes.items():
            client = KVTierClient(config, MODEL, BLOCK, KV_HEADS * HEAD_DIM, **options)
            procs = processes(client.store)
            puts_before = ray.get(client.store.stats.remote()).puts
            before, t0 = cpu_seconds(procs), time.perf_counter()
            handed = replay(client, f"tenant-{mode}", args)
            client.flush()
            wall = time.perf_counter() - t0
            after = cpu_seconds(procs)
            stats = client.stats()
            puts = ray.get(client.store.stats.remote()).puts - puts_before
            client.close()
            assert stats["tier_written_blocks"] == handed == puts, (stats, handed, puts)
            results[mode] = ({role: after[role] - before[role] for role in after}, handed, wall)
    finally:
        stop_embedded_database()
        ray.shutdown()
        shutil.rmtree(data_dir, ignore_errors=True)

    roles = list(next(iter(results.values()))[0])
    print(
        f"\n{args.conversations} conversations x {args.turns} turns ({args.turn_tokens} new prompt tokens, "
        f"{args.answer_tokens} decoded at {args.step_ms:g} ms a step): CPU seconds spent writing through"
    )
    print(f"{'process':<24}" + "".join(f"{mode:>12}" for mode in results) + f"{'ratio':>10}")
    for role in [*roles, "total"]:
        values = [sum(cpu.values()) if role == "total" else cpu[role] for cpu, _, _ in results.values()]
        ratio = values[1] / values[0] if values[0] else float("nan")
        print(f"{role:<24}" + "".join(f"{v:>12.2f}" for v in values) + f"{ratio:>9.2f}x")
    per_block = [sum(cpu.values()) / handed * 1e3 for cpu, handed, _ in results.values()]
    print(f"{'total per block (ms)':<24}" + "".join(f"{v:>12.2f}" for v in per_block))
    print(f"{'blocks written':<24}" + "".join(f"{handed:>12}" for _, handed, _ in results.values()))
    print(f"{'wall (s)':<24}" + "".join(f"{wall:>12.1f}" for _, _, wall in results.values()))


if __name__ == "__main__":
    main()
