"""Cluster KV tier, store and catalog alone: object-store put / get throughput and chain-lookup latency.

A 4K-token history of SmolLM2-135M is 256 blocks of 16 tokens, each block all 30 layers of K and V
(3 KV heads x 64 dims, bf16): 368,640 tensor bytes per block, 94 MB per history. One run:

  (a) encode / decode: codec speed of one history, in the calling process;
  (b) put: a replica-like caller hands the history to its node's KVTierStore actor in one
      `put_many` (bytes into the object store, owned by the store, plus one catalog upsert batch);
  (c) get: `get_many` for the history's refs, then `ray.get` of every block, raw and decoded; and
      the whole load a replica would do: catalog lookup + `load_chain` (fetch, decode, verify
      hash, parent, tokens and tenant of every block);
  (d) catalog: `longest_chain` of a full 256-hash history against a table holding other rows too,
      p50 / p99 over many lookups (one SQL round trip each);
  (e) a read during a write: `get_many` of a held history while another history's `put_many` is
      copying its bytes in, on a store serving one call at a time (as it used to) and on one serving
      `STORE_CONCURRENCY` calls at once (as `get_or_create_store` makes it).

Runs a local Ray and an embedded PostgreSQL in a temp dir, both stopped at the end. Every number
is measured in this run.

    python bench/kvtier_store.py [--rounds 3] [--lookups 300] [--filler-rows 20000]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np
import ray
import torch

from rayapp.blocks import hash_blocks
from rayapp.kvtier.catalog import BlockRow, Catalog
from rayapp.kvtier.codec import KVBlock, decode_block, encode_block
from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database
from rayapp.kvtier.loader import load_chain
from rayapp.kvtier.store import STORE_CONCURRENCY, KVTierStore, get_or_create_store

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 30, 16, 3, 64
HISTORY_TOKENS = 4096
DIM = KV_HEADS * HEAD_DIM


def history(seed: int) -> list[KVBlock]:
    """One 4K-token history: a hash chain of SmolLM2-shaped bf16 blocks (random values)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 49152, (HISTORY_TOKENS,), generator=g).tolist()
    hashes = hash_blocks(tokens, BLOCK, ("smollm2-135m", f"tenant-{seed}"))
    shape = (LAYERS, BLOCK, KV_HEADS, HEAD_DIM)
    blocks = []
    for i, h in enumerate(hashes):
        k, v = torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()
        ids = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        blocks.append(KVBlock(h, hashes[i - 1] if i else None, ids, "smollm2-135m", k, v, f"tenant-{seed}"))
    return blocks


def mb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def read_during_put(dsn: str, concurrency: int, rounds: int) -> list[float]:
    """Seconds a `get_many` of a held history takes while another history's `put_many` runs, per round."""
    store = (
        ray.remote(KVTierStore)
        .options(num_cpus=0, max_concurrency=concurrency)
        .remote(dsn, DIM, (rounds + 2) * 100 << 20)
    )
    held = history(100)
    assert all(ray.get(store.put_many.remote([np.frombuffer(encode_block(b), np.uint8) for b in held])).kept)
    hashes = [b.block_hash for b in held]
    seconds = []
    for r in range(rounds):
        incoming = [np.frombuffer(encode_block(b), np.uint8) for b in history(200 + r)]
        pending = store.put_many.remote(incoming)
        t0 = time.perf_counter()
        refs = ray.get(store.get_many.remote(hashes))
        seconds.append(time.perf_counter() - t0)
        assert all(ref is not None for ref in refs)
        assert all(ray.get(pending).kept)
    ray.kill(store)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="histories put and read back (median reported)")
    ap.add_argument("--lookups", type=int, default=300, help="chain lookups timed")
    ap.add_argument("--filler-rows", type=int, default=20_000, help="other blocks' rows in the catalog")
    args = ap.parse_args()

    ray.init(address="local", num_cpus=2, object_store_memory=1 << 30, include_dashboard=False)
    data_dir = tempfile.mkdtemp(prefix="rayapp-kvtier-bench-")
    try:
        dsn = start_embedded_database(f"{data_dir}/db")
        store = get_or_create_store(dsn, DIM, capacity_bytes=(args.rounds + 1) * 100 << 20)
        catalog = Catalog(dsn, DIM)

        encode_s, decode_s, put_s, get_raw_s, get_decoded_s, load_s, nbytes = [], [], [], [], [], [], 0
        chains = []
        for r in range(args.rounds):
            blocks = history(r)
            t0 = time.perf_counter()
            encoded = [np.frombuffer(encode_block(b), np.uint8) for b in blocks]
            encode_s.append(time.perf_counter() - t0)
            nbytes = sum(e.nbytes for e in encoded)
            t0 = time.perf_counter()
            kept = ray.get(store.put_many.remote(encoded)).kept
            put_s.append(time.perf_counter() - t0)
            assert all(kept), "the store refused blocks; is its capacity too small?"
            hashes = [b.block_hash for b in blocks]
            chains.append(hashes)
            del encoded

            t0 = time.perf_counter()
            raw = ray.get(ray.get(store.get_many.remote(hashes)))
            get_raw_s.append(time.perf_counter() - t0)
            del raw
            t0 = time.perf_counter()
            decoded = [decode_block(a) for a in ray.get(ray.get(store.get_many.remote(hashes)))]
            get_decoded_s.append(time.perf_counter() - t0)
            tokens = [t for b in blocks for t in b.token_ids]
            t0 = time.perf_counter()
            match = catalog.longest_chain(hashes)
            loaded = load_chain(match, tokens, BLOCK, ("smollm2-135m", f"tenant-{r}"))
            load_s.append(time.perf_counter() - t0)
            assert len(loaded) == len(blocks)
            del loaded
            t0 = time.perf_counter()
            encoded_again = [encode_block(b) for b in decoded]
            t1 = time.perf_counter()
            [decode_block(e) for e in encoded_again]
            decode_s.append(time.perf_counter() - t1)
            assert all(torch.equal(a.key.view(torch.int16), b.key.view(torch.int16)) for a, b in zip(blocks, decoded))
            del decoded, encoded_again

        rng = np.random.default_rng(0)
        filler = [
            BlockRow(int(h), None, "other-model", "", 0, "filler-node", "filler-store", 368_640, 16, None)
            for h in rng.integers(0, 2**63, args.filler_rows, dtype=np.int64)
        ]
        for i in range(0, len(filler), 5000):
            assert catalog.upsert(filler[i : i + 5000])
        upsert_s = []
        for r in range(args.rounds):
            # The catalog half of a put: one history's rows, as its store writes them (another node's names).
            rows = [BlockRow(h, None, "m", "", 1, "bench-node", "bench-store", 368_640, 16) for h in chains[r]]
            t0 = time.perf_counter()
            assert catalog.upsert(rows)
            upsert_s.append(time.perf_counter() - t0)
        latencies = []
        for i in range(args.lookups):
            t0 = time.perf_counter()
            match = catalog.longest_chain(chains[i % len(chains)])
            latencies.append(time.perf_counter() - t0)
            assert match.num_present == HISTORY_TOKENS // BLOCK
        latencies.sort()
        usage = catalog.usage()
        catalog.close()
        # Last: a store that starts drops its node's rows, the ones above included.
        serial, concurrent = (read_during_put(dsn, c, args.rounds) for c in (1, STORE_CONCURRENCY))
    finally:
        stop_embedded_database()
        ray.shutdown()
        shutil.rmtree(data_dir, ignore_errors=True)

    med = statistics.median
    print(f"\n4K-token SmolLM2 history: {HISTORY_TOKENS // BLOCK} blocks, {nbytes / 1e6:.1f} MB encoded; "
          f"{args.rounds} rounds, medians; catalog holds {usage.num_blocks} rows")  # fmt: skip
    print(f"{'step':<52}{'seconds':>10}{'MB/s':>10}")
    for name, times in (
        ("encode (codec, caller process)", encode_s),
        ("put_many -> store actor (object store + catalog)", put_s),
        ("get_many + ray.get (zero-copy views)", get_raw_s),
        ("get_many + ray.get + decode to tensors", get_decoded_s),
        ("lookup + load_chain (fetch, decode, verify)", load_s),
        ("decode alone (codec)", decode_s),
    ):
        print(f"{name:<52}{med(times):>10.3f}{mb_per_s(nbytes, med(times)):>10.0f}")
        if times is put_s:
            print(f"{'  (catalog upsert of 256 rows, timed alone)':<52}{med(upsert_s):>10.3f}")
    p50 = latencies[len(latencies) // 2] * 1e3
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
    print(f"\ncatalog longest_chain of {HISTORY_TOKENS // BLOCK} hashes, {args.lookups} lookups: "
          f"p50 {p50:.2f} ms, p99 {p99:.2f} ms")  # fmt: skip
    print(f"\nget_many of a held history while another history's put_many runs ({args.rounds} rounds, median):")
    print(f"  store serving one call at a time {med(serial) * 1e3:8.1f} ms")
    print(f"  store serving {STORE_CONCURRENCY} calls at once     {med(concurrent) * 1e3:8.1f} ms"
          f"   ({med(serial) / med(concurrent):.1f}x faster)")  # fmt: skip


if __name__ == "__main__":
    main()
