"""Cluster KV tier: time to first token on a cold engine for a 4K-token history, recompute vs load.

One run, same node, the shipped SmolLM2-135M:

  1. engine A (tier on) prefills a 4K-token history and writes its blocks through to the tier;
  2. engine B, cold (nothing cached locally), gets the history plus a short new turn: its blocks are
     loaded from the tier (catalog lookup, object store fetch, verify, install) and only the new turn
     is computed. Repeated `--repeats` times, B's local cache dropped in between;
  3. the same prompt recomputed from scratch (A detached from the tier, its cache dropped).

Printed: both times to first token and their ratio (the issue's bar: load >= 3x faster), the load's
parts, and the two numbers the load-vs-recompute threshold (`kvtier.min_load_tokens`) comes from:
recompute time per prompt token, and load time per block plus the fixed cost of one load. For the
store alone (put / get throughput, catalog latency) run bench/kvtier_store.py.

    python bench/kvtier.py [--history-tokens 4096] [--dtype bfloat16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import ray
import torch

from rayapp import LLM, SamplingParams
from rayapp.kvtier.embedded import stop_embedded_database

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the first token of a fresh request on `llm` (load or prefill included), and the token."""
    t0 = time.perf_counter()
    out = llm.generate(prompt_token_ids=prompt, sampling_params=FIRST_TOKEN)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0]


def timed_load(llm: LLM, prompt: list[int]) -> tuple[float, float, int]:
    """Seconds of the tier fetch (catalog + object store + verify) and of the install, and blocks loaded."""
    request = llm.engine.prepare_request("probe", prompt_token_ids=prompt, params=FIRST_TOKEN)
    plan = llm.engine.plan_tier_load(request)
    t0 = time.perf_counter()
    blocks = llm.engine.fetch_from_tier(request, plan)
    t1 = time.perf_counter()
    llm.engine.install_from_tier(request, plan, blocks)
    return t1 - t0, time.perf_counter() - t1, len(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3, help="cold loads timed (median reported)")
    args = ap.parse_args()

    ray.init(address="local", num_cpus=2, object_store_memory=2 << 30, include_dashboard=False)
    data_dir = tempfile.mkdtemp(prefix="rayapp-kvtier-bench-")
    tier = {"enabled": True, "data_dir": f"{data_dir}/db", "min_load_tokens": 16}
    try:
        g = torch.Generator().manual_seed(0)
        history = torch.randint(1000, 40000, (args.history_tokens,), generator=g).tolist()
        prompt = history + torch.randint(1000, 40000, (24,), generator=g).tolist()
        pages = (len(prompt) + 64) // 16 + 1
        a = LLM(dtype=args.dtype, num_pages=pages, kvtier=tier)
        t_write, _ = ttft(a, history)
        t0 = time.perf_counter()
        a.tier.flush()
        t_flush = time.perf_counter() - t0
        written = a.tier.counters["written_blocks"]

        b = LLM(dtype=args.dtype, num_pages=pages, kvtier=tier)
        loads, fetches, installs, loaded_tokens = [], [], [], 0
        for _ in range(args.repeats):
            assert b.engine.block_manager.reset_prefix_cache()
            before = b.stats()["tier_loaded_tokens"]
            t_load, token_loaded = ttft(b, prompt)
            loads.append(t_load)
            loaded_tokens = b.stats()["tier_loaded_tokens"] - before
            assert b.engine.block_manager.reset_prefix_cache()
            fetch_s, install_s, _ = timed_load(b, prompt)
            fetches.append(fetch_s)
            installs.append(install_s)
        # The fixed cost of one load: a one-block chain (catalog round trip, one get_many, one ray.get).
        assert b.engine.block_manager.reset_prefix_cache()
        one_block = []
        for _ in range(5):
            assert b.engine.block_manager.reset_prefix_cache()
            one_block.append(timed_load(b, history[:17])[0])

        a.engine.kv_transfer = None  # A recomputes without the tier from here on
        a.engine.block_manager.on_stored = None
        assert a.engine.block_manager.reset_prefix_cache()
        t_recompute, token_recomputed = ttft(a, prompt)
        a.close()
        b.close()
    finally:
        stop_embedded_database()
        ray.shutdown()
        shutil.rmtree(data_dir, ignore_errors=True)

    med = statistics.median
    blocks = len(history) // 16
    per_token = t_recompute / len(prompt)
    per_block = (med(fetches) + med(installs) - med(one_block)) / max(1, blocks - 1)
    fixed = med(one_block)
    # Loading n blocks beats recomputing them when fixed + n * per_block < n * 16 * per_token.
    gain = 16 * per_token - per_block
    threshold_blocks = fixed / gain if gain > 0 else float("inf")
    print(f"\nSmolLM2-135M {args.dtype}, {len(history)}-token history + 24-token new turn, 2 CPU cores")
    print(f"{'':<54}{'seconds':>10}")
    print(f"{'A: prefill history, write-through queued (TTFT)':<54}{t_write:>10.3f}")
    print(f"{'A: write-through drained after that (' + str(written) + ' blocks)':<54}{t_flush:>10.3f}")
    print(f"{'TTFT cold engine, recompute':<54}{t_recompute:>10.3f}")
    print(f"{'TTFT cold engine, load from tier (median)':<54}{med(loads):>10.3f}")
    print(f"{'  of which fetch: catalog + object store + verify':<54}{med(fetches):>10.3f}")
    print(f"{'  of which install into pages':<54}{med(installs):>10.3f}")
    print(f"ratio recompute / load: {t_recompute / med(loads):.1f}x (bar: >= 3x); "
          f"{loaded_tokens} of {len(prompt)} prompt tokens loaded; same first token: "
          f"{token_loaded == token_recomputed}")  # fmt: skip
    print(f"recompute {per_token * 1e3:.2f} ms/token ({16 * per_token * 1e3:.1f} ms/block); load "
          f"{per_block * 1e3:.2f} ms/block + {fixed * 1e3:.1f} ms per load -> loading pays from "
          f"{threshold_blocks:.2f} blocks ({threshold_blocks * 16:.0f} tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
