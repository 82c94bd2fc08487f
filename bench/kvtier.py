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

With `--engine vllm` the cold engine is vLLM (`vllm.LLM`) with the tier as its KV connector: for a
4K- and an 8K-token history, time to first token recomputed (another tenant's salt: nothing cached,
nothing in the tier) vs loaded from the tier into an emptied prefix cache, and the same two numbers
on rayapp's engine for the same histories.

    python bench/kvtier.py [--history-tokens 4096] [--dtype bfloat16] [--repeats 3]
    python bench/kvtier.py --engine vllm [--history-tokens 4096,8064]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time

import ray
import torch

from rayapp import LLM, SamplingParams
from rayapp.blocks import hash_blocks
from rayapp.engine.request import EngineRequest
from rayapp.kvtier.embedded import stop_embedded_database

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the first token of a fresh request on `llm` (load or prefill included), and the token."""
    t0 = time.perf_counter()
    out = llm.generate(prompt_token_ids=prompt, sampling_params=FIRST_TOKEN)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0]


def timed_load(llm: LLM, prompt: list[int]) -> tuple[float, float, int]:
    """Seconds of the tier fetch (catalog + object store + verify) and of the install, and blocks loaded."""
    seq = llm.engine.prepare_request(EngineRequest("probe", prompt, sampling=FIRST_TOKEN)).seq
    tier = llm.engine.tier
    prefix = llm.engine.block_manager.match_prefix(seq)
    ask = tier.ask(seq, prefix)
    t0 = time.perf_counter()
    load = tier.fetch(ask)
    t1 = time.perf_counter()
    tier.install(seq, load, prefix)
    return t1 - t0, time.perf_counter() - t1, len(load.blocks)


def prompts(history_tokens: int) -> tuple[list[int], list[int]]:
    """A random history and the prompt of the next turn (the history and 24 new tokens)."""
    g = torch.Generator().manual_seed(history_tokens)
    history = torch.randint(1000, 40000, (history_tokens,), generator=g).tolist()
    return history, history + torch.randint(1000, 40000, (24,), generator=g).tolist()


def rayapp_ttfts(
    history: list[int], prompt: list[int], dtype: str, repeats: int, tier: dict
) -> tuple[float, float, bool]:
    """On rayapp's engine: TTFT recomputed and loaded from the tier (median), and whether the first tokens match."""
    pages = (len(prompt) + 64) // 16 + 1
    a = LLM(dtype=dtype, num_pages=pages, kvtier=tier)
    ttft(a, history)
    a.tier.flush()
    b = LLM(dtype=dtype, num_pages=pages, kvtier=tier)
    loads = []
    for _ in range(repeats):
        assert b.engine.block_manager.reset_prefix_cache()
        t_load, token_loaded = ttft(b, prompt)
        loads.append(t_load)
    a.engine.detach_tier()
    assert a.engine.block_manager.reset_prefix_cache()
    t_recompute, token_recomputed = ttft(a, prompt)
    a.close()
    b.close()
    return t_recompute, statistics.median(loads), token_loaded == token_recomputed


def vllm_main(args: argparse.Namespace) -> None:
    import vllm

    from rayapp.config import KVTierConfig
    from rayapp.kvtier.catalog import Catalog
    from rayapp.kvtier.embedded import start_embedded_database
    from rayapp.models.loader import DEFAULT_MODEL, resolve_model
    from rayapp.vllm_ext.connector import kv_transfer_config
    from rayapp.vllm_ext.tier_protocol import LOADED_TOKENS_PARAM

    lengths = [int(n) for n in str(args.history_tokens).split(",")]
    ray.init(address="local", num_cpus=2, object_store_memory=2 << 30, include_dashboard=False)
    tier = KVTierConfig(enabled=True, data_dir=tempfile.mkdtemp(prefix="rayapp-kvtier-bench-") + "/db")
    rows = []
    try:
        llm = vllm.LLM(
            str(resolve_model(None)), dtype=args.dtype, block_size=128, kv_cache_memory_bytes=2 << 30,
            max_model_len=8192, kv_transfer_config=kv_transfer_config(tier, DEFAULT_MODEL),
        )  # fmt: skip
        catalog = Catalog(start_embedded_database(tier.data_dir), 3 * 64)
        first = vllm.SamplingParams(max_tokens=1, temperature=0)

        def timed(prompt: list[int], salt: str | None = None):
            request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
            t0 = time.perf_counter()
            out = llm.generate([request], first, use_tqdm=False)[0]
            return time.perf_counter() - t0, out

        for n in lengths:
            history, prompt = prompts(n)
            timed(history)
            hashes = hash_blocks(history, 128, (DEFAULT_MODEL, ""))
            while catalog.longest_chain(hashes).num_present < len(hashes):
                time.sleep(0.05)
            loads, recomputes = [], []
            for i in range(args.repeats):
                assert llm.reset_prefix_cache()
                t, loaded = timed(prompt)
                loads.append(t)
                assert (loaded.kv_transfer_params or {}).get(LOADED_TOKENS_PARAM) == len(history)
                t, recomputed = timed(prompt, salt=f"recompute-{i}")  # another tenant: no cache, no tier
                recomputes.append(t)
            same = loaded.outputs[0].token_ids == recomputed.outputs[0].token_ids
            rows.append(("vllm", n, statistics.median(recomputes), statistics.median(loads), same))
        llm.llm_engine.engine_core.shutdown()
        catalog.close()
        # The same tier (one store per node, bound to its database); rayapp's 16-token pages are other blocks.
        for n in lengths:
            rows.append(("rayapp", n, *rayapp_ttfts(*prompts(n), args.dtype, args.repeats, dataclasses.asdict(tier))))
    finally:
        stop_embedded_database()
        ray.shutdown()
    print(f"\nSmolLM2-135M {args.dtype}, cold engine, history + 24-token new turn, 2 CPU cores (median of "
          f"{args.repeats})")  # fmt: skip
    print(f"{'engine':<8}{'history':>9}{'TTFT recompute s':>18}{'TTFT tier load s':>18}{'ratio':>8}  same first token")
    for engine, n, recompute, load, same in rows:
        print(f"{engine:<8}{n:>9}{recompute:>18.3f}{load:>18.3f}{recompute / load:>7.1f}x  {same}")
    print("bar (vLLM, 4K): load >= 3x faster than recompute, same first token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="rayapp", choices=["rayapp", "vllm"])
    ap.add_argument("--history-tokens", default=None, help="tokens of history (vllm: comma-separated lengths)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3, help="cold loads timed (median reported)")
    args = ap.parse_args()
    if args.engine == "vllm":
        args.history_tokens = args.history_tokens or "4096,8064"
        vllm_main(args)
        return
    args.history_tokens = int(args.history_tokens or 4096)

    ray.init(address="local", num_cpus=2, object_store_memory=2 << 30, include_dashboard=False)
    data_dir = tempfile.mkdtemp(prefix="rayapp-kvtier-bench-")
    tier = {"enabled": True, "data_dir": f"{data_dir}/db", "min_load_tokens": 16}
    try:
        history, prompt = prompts(args.history_tokens)
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

        a.engine.detach_tier()  # A recomputes without the tier from here on
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
