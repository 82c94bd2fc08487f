"""Layer-wise KV compression (PyramidKV / SnapKV) vs dense on SmolLM2-135M: quality, memory, throughput. One run.

    PYTHONPATH=. python bench/layerwise.py                       # everything
    PYTHONPATH=. python bench/layerwise.py --only quality --cases 16
    PYTHONPATH=. python bench/layerwise.py --only quality --ratios 4 --kernels 5 9 13 17 --model /path/to/hf-dir

Quality (float32): needle-in-a-haystack accuracy over 1K-4K-token prompts and greedy agreement
with dense on natural text (share of the first tokens equal to dense's), at compression 2x, 4x
and 10x with the PyramidKV and uniform (SnapKV) schedules, pooling kernels 5 and 13 (`--kernels`, `--ratios`).
Each prompt is prefilled once: the dense prompt pages stay in the prefix cache in every layer, so
each further setting recomputes only the observation window. Memory: KV pages a sequence holds
after its prompt is compacted. Throughput (bfloat16): the same requests, distinct 2K-4K-token
prompts, through one engine with a fixed page pool, dense vs compressed; generated tokens per second
of the whole run (prefills included). Timings on a shared CPU are noisy; compare ratios.
"""

from __future__ import annotations

import argparse
import random
import time

from rayapp import LLM, SamplingParams
from rayapp.config import LayerwiseConfig
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.request import EngineRequest
from rayapp.sparse.evaluation import natural_text, needle_case

DENSE = LayerwiseConfig()


def variants(kernels: list[int], ratios: list[float]) -> dict[str, LayerwiseConfig]:
    v = {"dense": DENSE}
    for kernel in kernels:
        for ratio in ratios:
            for schedule in ("pyramid", "uniform"):
                v[f"{schedule} {ratio:g}x k{kernel}"] = LayerwiseConfig(
                    enabled=True, compression_ratio=ratio, schedule=schedule, kernel_size=kernel
                )
    return v


def run_quality(num_cases: int, new_tokens: int, settings: dict[str, LayerwiseConfig], model: str | None) -> None:
    # Room for every prompt in the prefix cache, so each is prefilled once for all settings.
    llm = LLM(model=model, dtype="float32", max_num_batched_tokens=2048, kv_cache_memory_gb=4.0)
    tok = llm.get_tokenizer()
    # Seeds from 100: kernel 13 was picked on seeds 0-7 while building this; these cases were not seen.
    lengths = [1000 + round(i * 3000 / max(1, num_cases - 1)) for i in range(num_cases)]
    depths = [0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6, 0.8]
    cases = [needle_case(tok, n, depths[i % len(depths)], seed=100 + i) for i, n in enumerate(lengths)]
    ids = tok.encode(natural_text() or "")
    natural = [ids[i * 700 : i * 700 + n] for i, n in enumerate((1200, 2000, 2800, 3600)) if len(ids) >= i * 700 + n]
    found: dict[str, int] = {}
    agree: dict[str, float] = {}
    pages: dict[str, int] = {}
    reference: list[list[int]] = []
    t0 = time.perf_counter()
    needle_params = SamplingParams(temperature=0.0, max_tokens=24)
    text_params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    for name, cfg in settings.items():
        llm.engine.reconfigure(layerwise=cfg)
        outs = llm.generate(prompt_token_ids=[c.prompt_token_ids for c in cases], sampling_params=needle_params)
        found[name] = sum(c.found(o.outputs[0].text) for c, o in zip(cases, outs))
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=natural, sampling_params=text_params)]
        reference = reference or got
        same = [
            next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) / len(r) for g, r in zip(got, reference)
        ]
        agree[name] = sum(same) / max(1, len(same))
        pages[name] = pages_after_prefill(llm.engine, cases[-1].prompt_token_ids)
        print(f"  {name}: needle {found[name]}/{len(cases)}, agreement {agree[name]:.2f}", flush=True)
    print(
        f"\n## Quality on SmolLM2-135M, float32 ({len(cases)} needle cases, {lengths[0]}-{lengths[-1]} tokens; "
        f"{len(natural)} natural-text prompts, first {new_tokens} greedy tokens; {time.perf_counter() - t0:.0f} s)"
    )
    print(
        f"full layers {DENSE.full_layers}, window {DENSE.window}; pages: KV pages (all layers) of the "
        f"{len(cases[-1].prompt_token_ids)}-token prompt after compaction"
    )
    header = f"{'setting':<22} {'needle found':>12} {'pts vs dense':>12} {'greedy agreement':>17}"
    print(header + f" {'pages':>6} {'vs dense':>8}")
    for name in settings:
        pts = 100 * (found[name] - found["dense"]) / len(cases)
        print(
            f"{name:<22} {found[name]:>6}/{len(cases):<5} {pts:>+12.1f} {agree[name]:>17.2f} {pages[name]:>6} "
            f"{pages[name] / pages['dense']:>8.2f}"
        )


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of `reference` that `tokens` repeat before the first difference."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
    return same / len(reference)


def pages_after_prefill(engine: LLMEngine, prompt: list[int]) -> int:
    """Pool pages one sequence holds right after its prompt ran (and, compressed, was compacted)."""
    before = engine.stats()["pages_used"]
    engine.add_request(EngineRequest("pages", prompt, sampling=SamplingParams(max_tokens=2)))
    while not any(out.request_id == "pages" for out in engine.step()):
        pass
    held = engine.stats()["pages_used"] - before
    engine.abort_request("pages")
    return held


def run_throughput(num_requests: int, pool_pages: int, new_tokens: int, model: str | None) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(2000, 4000) for _ in range(num_requests)]
    results = {}
    for name, cfg in (("dense", DENSE), ("pyramid 4x", LayerwiseConfig(enabled=True))):
        engine = LLMEngine.from_options(model=model, dtype="bfloat16", num_pages=pool_pages, layerwise=cfg)
        tok = engine.tokenizer
        prompts = [needle_case(tok, n, 0.5, seed=200 + i).prompt_token_ids for i, n in enumerate(lengths)]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(EngineRequest(str(i), ids, sampling=params))
        peak = generated = 0
        while engine.has_unfinished_requests():
            decoded = len(engine.step())
            generated += decoded
            peak = max(peak, decoded)
        wall = time.perf_counter() - t0
        stats = engine.stats()
        results[name] = (generated / wall, wall, peak, stats["num_preemptions"], sum(map(len, prompts)))
        print(
            f"  {name}: {generated} tokens in {wall:.1f} s, peak {peak} decoding, "
            f"{stats['num_preemptions']} preemptions",
            flush=True,
        )
    print(
        f"\n## Throughput, bfloat16, {num_requests} requests of 2K-4K prompt tokens + {new_tokens} generated, "
        f"pool of {pool_pages} pages (16 tokens, all layers)"
    )
    print(f"{'setting':<12} {'gen tok/s':>10} {'wall s':>8} {'peak decoding':>14} {'preemptions':>12} {'vs dense':>9}")
    for name, (rate, wall, peak, preempted, _) in results.items():
        print(f"{name:<12} {rate:>10.1f} {wall:>8.1f} {peak:>14} {preempted:>12} {rate / results['dense'][0]:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["quality", "throughput"])
    ap.add_argument("--cases", type=int, default=16, help="needle cases")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared on natural text")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pool-pages", type=int, default=480, help="about two dense 3.5K-token sequences")
    ap.add_argument("--generate", type=int, default=256, help="tokens generated per throughput request")
    ap.add_argument("--model", default=None, help="Hugging Face directory (default: the shipped SmolLM2-135M)")
    ap.add_argument("--kernels", type=int, nargs="+", default=[5, 13], help="pooling kernel sizes to compare")
    ap.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 10], help="compression ratios to compare")
    args = ap.parse_args()
    if args.only in (None, "quality"):
        run_quality(args.cases, args.new_tokens, variants(args.kernels, args.ratios), args.model)
    if args.only in (None, "throughput"):
        run_throughput(args.requests, args.pool_pages, args.generate, args.model)


if __name__ == "__main__":
    main()
