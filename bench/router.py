"""Request routing across replicas: rayapp's PrefixAwareRouter vs Serve's power-of-two vs Ray Serve LLM's
PrefixCacheAffinityRouter, on the same deployment and workload, in one run.

For each policy this starts a fresh Serve application from the same builder `rayapp.config.yaml` uses
(`--replicas`, default 2, of SmolLM2-135M-Instruct, bfloat16, sharing this machine's CPUs), only
`router.request_router_class` differing, and sends the multi-turn load of `bench/serve_multiturn.py`:
C conversations x T turns (default 16 x 6), all conversations concurrent, turns in order; each turn
re-sends the shared ~300-token system prompt plus the conversation's history and streams the answer
(temperature 0) over HTTP. Each conversation opens with its own pasted document of about
`--context-tokens` tokens (default 400; 0: none), so its history is worth keeping where it is.

Per policy it prints:
- delivered prefix-hit rate: cached prompt tokens the engines report (`usage.prompt_tokens_details.
  cached_tokens`) / reusable prompt tokens, over turns 2..T. A turn's reusable tokens are the previous
  turn's prompt rounded down to whole pages (the pages that turn left cached on the replica that
  served it). Turn 1 is left out: its only reusable part is the shared system prompt, which every
  replica soon holds whatever the policy. Also the same rate over the conversation's own history
  only (reusable tokens past the shared system prompt's pages), where policies differ;
- time to first token p50 / p90 over all turns, and output tokens/s (completion tokens / wall time);
- the ratios of rayapp's TTFT p50 to the two others'.

Ray Serve LLM's router is loaded from its internal module (the public `ray.serve.llm.request_router`
path refuses to import without vLLM or SGLang; it is the same class): it needs `pip install pyarrow`.
It reads the request's `prompt` (rayapp's `EngineRequest` carries the client's chat messages there)
with its own defaults (`imbalanced_threshold` inf, `match_rate_threshold` 0.1).

    python bench/router.py                       # 16 x 6, max_tokens 32, 400-token documents
    python bench/router.py --conversations 4 --turns 3 --policies rayapp pow2
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time

import ray
from chat_load import RequestRecord, http_turns, openai_client, percentile, run_conversation
from chat_servers import DEFAULT_MODEL
from chat_workloads import SYSTEM_PROMPT, support_script
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build
from rayapp.models.loader import resolve_model
from rayapp.models.tokenizer import chat_token_ids, load_tokenizer

POLICIES = {
    "rayapp": "rayapp.prefix_router:PrefixAwareRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "affinity": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter",
}
PAGE = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_prefix_tokens() -> int:
    """Tokens of the system prompt's pages that every conversation's prompt starts with."""
    tokenizer = load_tokenizer(resolve_model(None))
    a, b = (
        chat_token_ids(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
        for q in ("x", "y")
    )
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return common // PAGE * PAGE


def hit_rates(conversations: list[list[RequestRecord]], shared: int) -> tuple[float, float]:
    """(all reusable tokens, the conversations' own history only): cached / reusable over turns 2..T."""
    reusable = cached = own_reusable = own_cached = 0
    for records in conversations:
        for before, record in zip(records, records[1:]):
            can_reuse = min(before.prompt_tokens // PAGE, (record.prompt_tokens - 1) // PAGE) * PAGE
            hit = min(record.cached_tokens or 0, can_reuse)
            reusable, cached = reusable + can_reuse, cached + hit
            own_reusable, own_cached = own_reusable + can_reuse - shared, own_cached + max(0, hit - shared)
    return cached / reusable, own_cached / own_reusable


async def _load(base_url: str, args: argparse.Namespace) -> tuple[list, float]:
    async with openai_client(base_url) as client:
        start = time.perf_counter()
        per_conversation = await asyncio.gather(
            *(
                run_conversation(
                    http_turns(client, DEFAULT_MODEL),
                    support_script(c, args.turns, args.max_tokens, args.context_tokens),
                )
                for c in range(args.conversations)
            )
        )
        return per_conversation, time.perf_counter() - start


def measure(policy: str, args: argparse.Namespace) -> dict[str, float]:
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    router: dict = {"request_router_class": POLICIES[policy]}
    if args.queue_weight_tokens is not None:
        router["queue_weight_tokens"] = args.queue_weight_tokens
    try:
        config = AppConfig(
            dtype="bfloat16",
            replicas=args.replicas,
            num_cpus=1 / args.replicas,
            kv_cache_memory_gb=1.0,
            router=router,
        )
        serve.run(build(config), name="rayapp", route_prefix="/")
        conversations, wall_s = asyncio.run(_load(f"http://127.0.0.1:{port}", args))
    finally:
        serve.shutdown()
    records = [r for c in conversations for r in c]
    ttfts = [r.ttft_s for r in records]
    hit_rate, history_hit_rate = hit_rates(conversations, args.shared)
    return {
        "hit_rate": hit_rate,
        "history_hit_rate": history_hit_rate,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p90_ms": percentile(ttfts, 90) * 1000,
        "output_tok_s": sum(r.completion_tokens for r in records) / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2, help="replicas sharing this machine's 2 CPUs")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=400)
    parser.add_argument(
        "--queue-weight-tokens", type=float, default=None, help="rayapp router's load weight (default: the config's)"
    )
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["pow2", "affinity", "rayapp"])
    args = parser.parse_args()
    args.shared = shared_prefix_tokens()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    for policy in args.policies:
        results[policy] = measure(policy, args)
        print(f"{policy:>9}: " + "  ".join(f"{k} {v:.3f}" for k, v in results[policy].items()), flush=True)
    ray.shutdown()
    print(
        f"\n{args.conversations} conversations x {args.turns} turns, max_tokens {args.max_tokens}, "
        f"~{args.context_tokens}-token documents, {args.shared} shared system-prompt tokens, {args.replicas} replicas"
    )
    print(f"{'policy':>9} | hit rate | history hit rate | TTFT p50 ms | TTFT p90 ms | out tok/s")
    for policy, r in results.items():
        print(
            f"{policy:>9} | {r['hit_rate']:8.3f} | {r['history_hit_rate']:16.3f} | {r['ttft_p50_ms']:11.0f} | "
            f"{r['ttft_p90_ms']:11.0f} | {r['output_tok_s']:9.1f}"
        )
    if "rayapp" in results:
        for other in (p for p in results if p != "rayapp"):
            ratio = results["rayapp"]["ttft_p50_ms"] / results[other]["ttft_p50_ms"]
            print(f"TTFT p50 rayapp / {other}: {ratio:.2f}")


if __name__ == "__main__":
    main()
