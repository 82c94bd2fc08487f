"""The `retrieval` plugin in vLLM against stock vLLM, one run (`python bench/sparse_attention.py --engine vllm`).

Speed: decode-step time and attention time of one sequence at each context, stock vLLM vs vLLM with the
plugin (its default settings: init 1024, window 7192, top-k 0.2 of 128-token blocks, dense below 32K... so
the plugin is set to go sparse from 16K here), the shipped SmolLM2's weights with its positions stretched
(past 8K the answers mean nothing; the work per token is the real model's), bfloat16, vLLM's CPU pages of
128. A decode step's time is (time of 1 + n new tokens - time of 1) / n on a prefix-cached prompt, and its attention
the same difference of the attention layers' forward time (the plugin's scoring and selection included),
after the first decode steps over the history (which compute its block representations, reported apart).

Quality: needle-in-a-haystack at settings scaled to SmolLM2's 8K (as `--engine rayapp`): stock vLLM,
vLLM with the plugin, and rayapp's engine with sparse retrieval, on the same prompts, float32.

Each system runs in a child process of its own (`--worker`), so every engine starts clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The RetrievalKV plugin's values (rayapp.config.RETRIEVALKV_DEFAULTS), sparse from 16K.
SPEED_SETTINGS = {"init_tokens": 1024, "local_tokens": 7192, "dense_boundary": 16000, "offload_boundary": 65536}
QUALITY_SETTINGS = {"init_tokens": 64, "local_tokens": 512, "retrieval_block_size": 64, "dense_boundary": 1024}
DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6, 0.8]


def needle_cases(num_cases: int):
    from rayapp.models.loader import resolve_model
    from rayapp.models.tokenizer import load_tokenizer
    from rayapp.sparse.evaluation import needle_case

    tok = load_tokenizer(resolve_model(None))
    lengths = [1200 + round(i * 4800 / max(1, num_cases - 1)) for i in range(num_cases)]
    return tok, [needle_case(tok, n, DEPTHS[i % len(DEPTHS)], seed=500 + i) for i, n in enumerate(lengths)]


def speed_worker(system: str, contexts: list[int], steps: int) -> dict:
    """In a fresh process: decode step and attention time per context, for `system` (stock | plugin)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, so its attention is timed
    from long_model import long_model_dir
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = CPUAttentionBackendImpl
    if system == "plugin":
        from rayapp.vllm_ext.retrieval_backend import RetrievalCPUImpl

        impl = RetrievalCPUImpl
    spent = [0.0]
    forward = impl.forward

    def timed(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        t = time.perf_counter()
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    impl.forward = timed
    longest = max(contexts) + steps + 8
    llm = LLM(
        str(long_model_dir(longest)), dtype="bfloat16", max_model_len=longest, enforce_eager=True,
        kv_cache_memory_bytes=int(2.5 * 2**30), max_num_batched_tokens=4096,
    )  # fmt: skip
    result = {}
    for ctx in contexts:
        prompt = TokensPrompt(prompt_token_ids=[(7 * i) % 30000 + 100 for i in range(ctx)])

        def run(n: int, prompt: TokensPrompt = prompt) -> float:
            t = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False)
            return time.perf_counter() - t

        run(1)  # prefill once; the timed runs hit vLLM's prefix cache
        spent[0] = 0.0
        one = run(1)  # the prompt's last token again (vLLM recomputes it on a full hit): not a decode step
        one_attn = spent[0]
        # The first decode steps over a history compute its block representations (once: a later turn over the
        # same pages keeps them); then every step only scores and attends.
        cold = run(1 + steps)
        spent[0] = 0.0
        many = run(1 + steps)
        result[ctx] = {
            "step_ms": 1e3 * (many - one) / steps,
            "attn_ms": 1e3 * (spent[0] - one_attn) / steps,
            "first_steps_ms": 1e3 * (cold - one) / steps,
        }
    return result


def quality_worker(system: str, num_cases: int) -> dict:
    """In a fresh process: which needle cases `system` (stock | plugin | rayapp) finds."""
    from rayapp.models.loader import resolve_model

    tok, cases = needle_cases(num_cases)
    if system == "rayapp":
        from rayapp import LLM
        from rayapp import SamplingParams as RayappParams

        llm = LLM(dtype="float32", sparse={"enabled": True, **QUALITY_SETTINGS})
        params = RayappParams(temperature=0, max_tokens=16)
        texts = [llm.generate(prompt_token_ids=c.prompt_token_ids, sampling_params=params)[0] for c in cases]
        texts = [t.outputs[0].text for t in texts]
        stats = {k: v for k, v in llm.stats().items() if k.startswith("sparse_")}
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from rayapp.vllm_ext.retrieval import WORKER_EXTENSION

        llm = LLM(
            str(resolve_model(None)), dtype="float32", block_size=64, enforce_eager=True,
            kv_cache_memory_bytes=1 << 30, worker_extension_cls=WORKER_EXTENSION,
        )  # fmt: skip
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=c.prompt_token_ids) for c in cases],
            SamplingParams(temperature=0, max_tokens=16), use_tqdm=False,
        )  # fmt: skip
        texts = [o.outputs[0].text for o in outs]
        stats = llm.collective_rpc("retrieval_stats")[0] if system == "plugin" else {}
    return {"found": [c.found(t) for c, t in zip(cases, texts)], "stats": stats}


def _child(args: list[str], plugin_settings: dict | None) -> dict:
    env = dict(os.environ)
    env["VLLM_PLUGINS"] = "retrieval" if plugin_settings is not None else ""
    if plugin_settings is not None:
        env["RAYAPP_RETRIEVAL_SETTINGS"] = json.dumps(plugin_settings)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [sys.executable, str(Path(__file__).with_name("sparse_attention.py")), "--engine", "vllm", *args]
        subprocess.run([*cmd, "--result", result.name], env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(result.name).read_text())


def run(only: str | None, contexts: list[int], steps: int, num_cases: int) -> None:
    """Both systems' children, then the tables with ratios."""
    if only in (None, "speed"):
        ctx = [str(c) for c in contexts]
        stock = _child(["--worker", "stock", "--only", "speed", "--contexts", *ctx, "--steps", str(steps)], None)
        plugin = _child(
            ["--worker", "plugin", "--only", "speed", "--contexts", *ctx, "--steps", str(steps)], SPEED_SETTINGS
        )
        print("\n## Decode step, 1 sequence, SmolLM2-135M (positions stretched), bfloat16, vLLM CPU pages of 128")
        print("plugin: init 1024, window 7192, top-k 0.2 of 128-token blocks, multimean; sparse from 16K; ms")
        print(f"{'context':>8} {'stock step':>10} {'plugin step':>11} {'ratio':>6} {'stock attn':>10} "
              f"{'plugin attn':>11} {'ratio':>6} {'plugin, first steps':>19}")  # fmt: skip
        for c in ctx:
            s, p = stock[c], plugin[c]
            print(
                f"{c:>8} {s['step_ms']:>10.1f} {p['step_ms']:>11.1f} {p['step_ms'] / s['step_ms']:>6.2f} "
                f"{s['attn_ms']:>10.1f} {p['attn_ms']:>11.1f} {p['attn_ms'] / s['attn_ms']:>6.2f} "
                f"{p['first_steps_ms']:>19.1f}"
            )
        print(f"(plugin, first steps: a decode step's mean over the first {steps} steps of a history, which compute")
        print(" its block representations; the other columns are later steps, as on a second turn)")
    if only in (None, "quality"):
        n = ["--cases", str(num_cases)]
        found = {
            "stock vLLM (dense)": _child(["--worker", "stock", "--only", "quality", *n], None),
            "vLLM + retrieval plugin": _child(["--worker", "plugin", "--only", "quality", *n], QUALITY_SETTINGS),
            "rayapp engine, sparse": _child(["--worker", "rayapp", "--only", "quality", *n], None),
        }
        print(f"\n## Needle in a haystack, {num_cases} cases of 1.2K-6K tokens, SmolLM2-135M float32; sparse at")
        print("init 64, window 512, retrieval blocks of 64, top-k 0.2, dense below 1024")
        print(f"{'system':<26} {'found':>7} {'vs dense':>9}  sparse path ran")
        dense = sum(found["stock vLLM (dense)"]["found"])
        for name, r in found.items():
            stats, got = r["stats"], sum(r["found"])
            ran = (
                f"{stats['sparse_decode_steps_sparse']} decode steps" if "sparse_decode_steps_sparse" in stats
                else f"{stats['sparse_seqs_sparse']} sequences" if "sparse_seqs_sparse" in stats
                else "-"
            )  # fmt: skip
            print(f"{name:<26} {got:>3}/{num_cases:<3} {got / max(dense, 1):>9.2f}  {ran}")


def worker_main(system: str, only: str, contexts: list[int], steps: int, num_cases: int, result: str) -> None:
    """A child's whole job: measure `system`, write the numbers to the file `result`."""
    found = speed_worker(system, contexts, steps) if only == "speed" else quality_worker(system, num_cases)
    Path(result).write_text(json.dumps(found))
