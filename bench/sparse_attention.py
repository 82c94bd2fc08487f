"""Sparse retrieval attention (RetrievalKV) vs dense: speed, KV bytes, device memory, quality. One run.

    PYTHONPATH=. python bench/sparse_attention.py            # everything
    PYTHONPATH=. python bench/sparse_attention.py --only quality --cases 12
    PYTHONPATH=. python bench/sparse_attention.py --only resume     # a 64K history resumed from the cluster tier
    PYTHONPATH=. python bench/sparse_attention.py --engine vllm --contexts 16384 32768   # the vLLM plugin
    PYTHONPATH=. python bench/sparse_attention.py --kernels triton --only quality  # Triton kernels' report first

Speed and memory use a random-weight model of SmolLM2-135M's shape (30 layers, 9 query / 3 KV
heads of 64) at 8K-64K contexts, since the shipped model stops at 8K. Quality uses the shipped
SmolLM2 with settings scaled to its 8K context (init 64, window 512, retrieval block 64,
dense boundary 1024, offload boundary 2048): needle-in-a-haystack over 1K-6K prompts, and greedy
agreement with dense on natural text. Timings on a shared CPU are noisy; compare ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
from long_model import long_model_dir

from rayapp import LLM, SamplingParams
from rayapp.config import RETRIEVALKV_DEFAULTS, SparseConfig
from rayapp.engine.request import EngineRequest
from rayapp.sparse.evaluation import SCALED_SPARSE, natural_text, needle_case

# Quality runs on device (offload attends the same pages, tested).
SCALED = SparseConfig(**{**SCALED_SPARSE, "offload_boundary": 8192})


def quality_variants(topks: tuple[float, ...] = (0.2, 0.1, 0.05)) -> dict[str, SparseConfig | None]:
    """Dense, the plain scorers (one query), the default scorer, and the oracle, at each top-k."""
    default = SparseConfig()
    ours = f"multimean{default.representative_keys}/q{default.scoring_queries}"
    v: dict[str, SparseConfig | None] = {"dense": None}
    for topk in topks:
        for name, rep in (("mean", "mean"), ("minmax", "minmax"), (ours, "multimean"), ("oracle", "oracle")):
            plain = rep in ("mean", "minmax", "oracle")
            v[f"{name}@{topk}"] = dataclasses.replace(
                SCALED, representation=rep, topk_percent=topk, scoring_queries=1 if plain else default.scoring_queries
            )
    return v


def run_quality(
    num_cases: int, variants: dict[str, SparseConfig | None], new_tokens: int = 24, with_text: bool = True
) -> None:
    """Needle accuracy and greedy agreement with dense, each prompt prefilled once (prefix cache)."""
    llm = LLM(dtype="float32", max_num_batched_tokens=2048)
    tok = llm.get_tokenizer()
    lengths = [1024 + round(i * 5000 / max(1, num_cases - 1)) for i in range(num_cases)]
    depths = [0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6, 0.8]
    cases = [needle_case(tok, n, depths[i % len(depths)], seed=i) for i, n in enumerate(lengths)]
    text = natural_text() if with_text else None
    natural: list[list[int]] = []
    if text:
        ids = tok.encode(text)
        natural = [ids[i * 300 : i * 300 + n] for i, n in enumerate((1500, 3000, 4500, 6000)) if len(ids) >= n]
    found = {name: 0 for name in variants}
    agree = {name: [] for name in variants}
    needle_params = SamplingParams(temperature=0.0, max_tokens=16)
    text_params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    t0 = time.perf_counter()
    for case in cases:
        for name, cfg in variants.items():
            llm.engine.reconfigure(sparse=cfg or dataclasses.replace(SCALED, enabled=False))
            out = llm.generate(prompt_token_ids=case.prompt_token_ids, sampling_params=needle_params)[0]
            found[name] += case.found(out.outputs[0].text)
        print(
            f"  case {len(case.prompt_token_ids)} tokens, depth {case.depth}: "
            + ", ".join(f"{k}={v}" for k, v in found.items()),
            flush=True,
        )
    for ids in natural:
        reference: list[int] = []
        for name, cfg in variants.items():
            llm.engine.reconfigure(sparse=cfg or dataclasses.replace(SCALED, enabled=False))
            got = llm.generate(prompt_token_ids=ids, sampling_params=text_params)[0].outputs[0].token_ids
            reference = reference or got
            same = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), len(reference))
            agree[name].append(same / len(reference))
    print(
        f"\n## Quality on SmolLM2-135M ({len(cases)} needle cases, {lengths[0]}-{lengths[-1]} tokens; "
        f"{len(natural)} natural-text prompts, first {new_tokens} greedy tokens; {time.perf_counter() - t0:.0f} s)"
    )
    print(f"{'scorer@topk':<18} {'needle found':>12} {'vs dense':>9} {'greedy agreement':>17}")
    for name in variants:
        ag = sum(agree[name]) / len(agree[name]) if agree[name] else float("nan")
        ratio = found[name] / found["dense"] if found["dense"] else float("nan")
        print(f"{name:<18} {found[name]:>6}/{len(cases):<5} {ratio:>9.2f} {ag:>17.2f}")


def run_speed(contexts: list[int], steps: int) -> None:
    """Decode-step time (whole model and attention alone), KV bytes read, and device KV memory."""
    from rayapp.engine.attention import PagedAttention
    from rayapp.engine.pages import OFFLOADED
    from rayapp.engine.scheduler import ScheduledBatch
    from rayapp.engine.sequence import Sequence

    attention_time = [0.0]
    original = PagedAttention.__call__

    def timed(self, layer, q, k, v):  # CPU ops are synchronous, so wall time is the op's time
        t = time.perf_counter()
        out = original(self, layer, q, k, v)
        attention_time[0] += time.perf_counter() - t
        return out

    PagedAttention.__call__ = timed
    default = SparseConfig(enabled=True, device_cache_blocks=128, **RETRIEVALKV_DEFAULTS)
    longest = max(contexts) + 64
    llm = LLM(
        model=str(long_model_dir(longest)),
        dtype="float32",
        num_pages=longest // 16 + 8,
        # Built in offload mode so the device block cache exists; each run below picks its mode.
        sparse=dataclasses.replace(default, dense_boundary=16000, offload_boundary=16000),
        max_model_len=longest,
    )
    engine, runner = llm.engine, llm.engine.runner
    spec = engine.spec
    token_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * runner.dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    modes = {
        "dense": dataclasses.replace(default, enabled=False),
        "sparse": dataclasses.replace(default, dense_boundary=16000, offload_boundary=10**6),
        "offload": dataclasses.replace(default, dense_boundary=16000, offload_boundary=16000),
    }
    print("\n## Decode step, 1 sequence, SmolLM2-135M shape with its real weights (positions stretched), float32")
    print("sparse: init 1024, window 7192, retrieval block 128, top-k 0.2, multimean scorer; times in ms")
    header = f"{'context':>8} {'mode':>8} {'step':>8} {'attn':>8} {'step/dense':>10} {'attn/dense':>10}"
    print(header + f" {'KV read MB':>10} {'read/dense':>10} {'device KV MB':>12} {'dev/dense':>9} {'copied':>7}")
    for ctx in contexts:
        dense_ref: dict[str, float] = {}
        for mode, cfg in modes.items():
            if mode != "dense" and ctx < cfg.dense_boundary:
                continue
            engine.reconfigure(sparse=cfg)
            sparse = engine.extension("sparse")
            # A prefilled prompt of ctx - 1 tokens and one generated token to decode.
            seq = Sequence(f"bench-{ctx}-{mode}", [1] * (ctx - 1), SamplingParams(max_tokens=steps + 2))
            seq.append_token(1)
            engine.block_manager.allocate(seq, ctx)
            pages = torch.tensor(seq.block_table)
            # Random K/V, not zeros: scores must rank blocks as they would on real keys' spread.
            for cache in (runner.pool.k, runner.pool.v):
                cache[:, pages] = torch.randn(cache[:, pages].shape, generator=gen, dtype=cache.dtype)
            seq.num_computed_tokens = ctx - 1
            if sparse is not None:
                sparse.after_step([seq])  # representations, and offload in offload mode
            device_pages = sum(1 for p in seq.block_table if p != OFFLOADED)
            times, attn = [], []
            for step in range(steps + 1):
                batch = ScheduledBatch(seqs=[seq], num_new_tokens=[1], num_decodes=1)
                if sparse is not None:
                    sparse.begin_step()
                attention_time[0] = 0.0
                t = time.perf_counter()
                runner.run(batch, engine.extensions.values())
                if step:
                    times.append(time.perf_counter() - t)
                    attn.append(attention_time[0])
                if sparse is not None:
                    sparse.end_step()
            stats = engine.stats()
            copied = stats.get("sparse_blocks_copied_last_step", 0)
            if sparse is None:
                read_tokens = ctx
                device_tokens = ctx
            else:
                p = sparse.policy
                k = p.num_selected(p.num_middle_blocks(ctx))
                read_tokens = ctx - (p.num_middle_blocks(ctx) - k) * p.config.retrieval_block_size
                device_tokens = device_pages * 16
                if mode == "offload":
                    device_tokens += sparse.num_cache_blocks * p.config.retrieval_block_size
            step_ms, attn_ms = 1e3 * _median(times), 1e3 * _median(attn)
            read_mb, dev_mb = read_tokens * token_bytes / 2**20, device_tokens * token_bytes / 2**20
            if mode == "dense":
                dense_ref = {"step": step_ms, "attn": attn_ms, "read": read_mb, "dev": dev_mb}
            print(
                f"{ctx:>8} {mode:>8} {step_ms:>8.1f} {attn_ms:>8.1f} {step_ms / dense_ref['step']:>10.2f} "
                f"{attn_ms / dense_ref['attn']:>10.2f} {read_mb:>10.1f} {read_mb / dense_ref['read']:>10.2f} "
                f"{dev_mb:>12.1f} {dev_mb / dense_ref['dev']:>9.2f} {copied:>7}"
            )
            engine.block_manager.free(seq)
            if sparse is not None:
                sparse.drop(seq)
    PagedAttention.__call__ = original


def run_resume(context: int, steps: int) -> None:
    """Device KV of a `context`-token history resumed from the cluster tier: dense (every page on the device)
    vs sparse retrieval with offload at its defaults (the middle goes to the host pool; the device holds the
    init pages, the window and the selected blocks). The history's K/V is random: what is measured is where
    it goes, not what the model answers."""
    import ray

    from rayapp.engine.sequence import Sequence
    from rayapp.kvtier.embedded import stop_embedded_database

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    model, bf16 = str(long_model_dir(context + 64)), torch.bfloat16
    common = dict(model=model, dtype="bfloat16", num_pages=context // 16 + 64, max_model_len=context + 64)
    tier = {"enabled": True, "capacity_bytes": 8 << 30}
    offload = SparseConfig(enabled=True, **RETRIEVALKV_DEFAULTS)
    tokens = torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        writer = LLM(**common, kvtier=tier)
        seq = Sequence("history", tokens, SamplingParams())
        bm, runner = writer.engine.block_manager, writer.engine.runner
        bm.allocate(seq, context, bm.match_prefix(seq))
        pages = torch.tensor(seq.block_table)
        for cache in (runner.pool.k, runner.pool.v):
            cache[:, pages] = torch.randn(cache[:, pages].shape, dtype=torch.float32).to(bf16)
        # Written through to the tier a run of pages at a time: its writer drops what is queued past 512 MiB.
        for end in range(4096, context + 4096, 4096):
            seq.num_computed_tokens = min(end, context)
            bm.cache_full_blocks(seq)
            writer.tier.flush()
        bm.free(seq)
        writer.close()
        print(f"\n## A {context}-token history resumed from the cluster tier on a cold engine, bfloat16")
        print("sparse: the defaults (init 1024, window 7192, retrieval block 128, top-k 0.2, offload above 64K)")
        header = f"{'mode':>8} {'TTFT s':>8} {'peak device pages':>18}"
        print(header + f" {'device KV MB':>13} {'dev/dense':>9} {'host MB':>8}")
        dense_mb = 0.0
        for mode, sparse in (("dense", None), ("offload", offload)):
            llm = LLM(**common, kvtier=tier, **({} if sparse is None else {"sparse": sparse}))
            engine = llm.engine
            page_mb = engine.runner.page_bytes / 2**20
            params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
            request = engine.prepare_request(EngineRequest(f"resume-{mode}", tokens, sampling=params))
            t0 = time.perf_counter()
            engine.tier.load_now(request.seq)
            peak = engine.stats()["pages_cached"]  # the loaded history, before admission
            engine.enqueue(request)
            while not request.seq.output_token_ids:
                engine.step()
            ttft = time.perf_counter() - t0
            while engine.has_unfinished_requests():  # decode: the selection's blocks come in from the host
                before = engine.stats()
                engine.step()
            stats = before  # the last decode step's: the request ended with it
            device = stats["pages_used"]
            if sparse is not None:  # the device block cache this sequence selects into (k blocks, every layer)
                p = engine.extension("sparse").policy
                device += p.num_selected(p.num_middle_blocks(context)) * p.pages_per_block
            mb = device * page_mb
            dense_mb = dense_mb or mb
            host = stats.get("sparse_host_pages_held", 0) * page_mb
            print(f"{mode:>8} {ttft:>8.2f} {peak:>18} {mb:>13.1f} {mb / dense_mb:>9.2f} {host:>8.1f}")
            llm.close()
    finally:
        stop_embedded_database()
        ray.shutdown()


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["speed", "quality", "resume"], default=None)
    parser.add_argument("--cases", type=int, default=12, help="needle cases (1K-6K tokens)")
    parser.add_argument("--topk", type=float, nargs="+", default=[0.2, 0.1, 0.05])
    parser.add_argument("--no-text", action="store_true", help="skip greedy agreement on natural text")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--resume-context", type=int, default=65600, help="history resumed from the tier (resume)")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per setting (after one warm-up)")
    parser.add_argument(
        "--engine", choices=["rayapp", "vllm"], default="rayapp", help="vllm: the retrieval plugin vs stock vLLM"
    )
    parser.add_argument(
        "--kernels",
        choices=["cpu", "triton"],
        default="cpu",
        help="triton: first report the Triton kernels' compile times per GPU target and their interpreter check "
        "(bench/triton_kernels.py); the run itself keeps the CPU kernels (PyTorch and C++)",
    )
    parser.add_argument("--worker", choices=["stock", "plugin", "rayapp"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kernels == "triton" and not args.worker:
        import triton_kernels

        triton_kernels.run()
    if args.engine == "vllm":
        import sparse_vllm

        if args.worker:
            sparse_vllm.worker_main(args.worker, args.only, args.contexts, args.steps, args.cases, args.result)
        else:
            sparse_vllm.run(args.only, args.contexts, args.steps, args.cases)
        return
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; python {sys.version.split()[0]}")
    if args.only in (None, "speed"):
        run_speed(args.contexts, args.steps)
    if args.only in (None, "quality"):
        run_quality(args.cases, quality_variants(tuple(args.topk)), with_text=not args.no_text)
    if args.only in (None, "resume"):
        run_resume(args.resume_context, args.steps)


if __name__ == "__main__":
    main()
